"""Tensor-parallel shards: which slice of each weight a rank holds.

`shard_model(model, cfg, tp)` rewrites a model built on the meta device (before `to_empty`) to one
rank's shapes and returns the `Shards` map the loader slices by (`load_weights(..., shards=...)`),
so a rank never reads or holds a full tensor of a split weight. The memory plan counts the same
meta-built shard, so planned and allocated bytes agree by construction. The split:

- attention: each attention module shards itself (`module.shard(prefix, tp, shards)`, with the
  `column` / `row` helpers here): heads column-parallel, the output projection row-parallel;
- dense MLP and shared experts: gate/up column-parallel, down row-parallel, ceil(I/tp) per rank
  (the last rank zero-padded when I % tp != 0: silu(0) * 0 adds nothing);
- embeddings and lm_head vocab-parallel, ceil(vocab/tp) rows per rank.

Row-parallel outputs are partial sums: the runner all-reduces once after the attention output and
once after each MLP/MoE block (where the routed experts' part joins the shared experts' before the
one all-reduce). The vocab-parallel embedding all-reduces itself; the lm_head all-gathers the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ktlite.runtime.models.base import LMHead
from ktlite.runtime.models.fp8 import FP8Linear
from ktlite.runtime.models.layers import MLP, MoE

Shards = dict[str, tuple[int, int, int]]  # HF name -> (dim, start, stop) in the checkpoint tensor


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel group (the default torch.distributed group)."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along the last dim (rank order)."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(nn.Module):
    plan_component = "embeddings"
    """Rows start .. start + ceil(vocab/tp) of the embedding; ids elsewhere give 0, then all-reduce."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.rows = _ceil_div(vocab, tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


@dataclass(frozen=True)
class GatherVocab:
    """Every rank's vocab shard of the logits, concatenated and cut to the vocab size."""

    tp: TPContext
    vocab: int

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(logits)[..., : self.vocab]


class VocabParallelLMHead(LMHead):
    """ceil(vocab/tp) rows of lm_head; the logits of all ranks are gathered (every rank gets all). The
    gather is `output_op`, which a CPU-only run's quantized replacement of the layer keeps."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext):
        super().__init__(hidden, _ceil_div(vocab, tp.size), bias=False)
        self.output_op = GatherVocab(tp, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_op(super().forward(x))


def _resized(layer: nn.Module, in_features: int, out_features: int) -> nn.Module:
    if isinstance(layer, FP8Linear):
        return FP8Linear(in_features, out_features, bias=layer.bias is not None)
    return nn.Linear(in_features, out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)


def split(total: int, tp: TPContext) -> tuple[int, int, int]:
    """(per-rank size, start, stop) of rank's ceil-sized part of `total` (stop clipped to total)."""
    size = _ceil_div(total, tp.size)
    start = min(tp.rank * size, total)
    return size, start, min(start + size, total)


def column(parent: nn.Module, name: str, prefix: str, total_out: int, tp: TPContext, shards: Shards,
           part: tuple[int, int] | None = None) -> None:
    """Output rows of `parent.name` split over ranks (`part` = (start, stop) overrides the even split)."""
    layer = getattr(parent, name)
    if part is None:
        size, start, stop = split(total_out, tp)
    else:
        (start, stop), size = part, part[1] - part[0]
    setattr(parent, name, _resized(layer, layer.in_features, size))
    shards[f"{prefix}{name}.weight"] = (0, start, stop)
    if layer.bias is not None:
        shards[f"{prefix}{name}.bias"] = (0, start, stop)


def row(parent: nn.Module, name: str, prefix: str, total_in: int, tp: TPContext, shards: Shards) -> None:
    """Input columns of `parent.name` split over ranks (its output is a partial sum)."""
    layer = getattr(parent, name)
    size, start, stop = split(total_in, tp)
    setattr(parent, name, _resized(layer, size, layer.out_features))
    shards[f"{prefix}{name}.weight"] = (1, start, stop)


def _shard_mlp(mlp: MLP, prefix: str, tp: TPContext, shards: Shards) -> None:
    inter = mlp.gate_proj.out_features
    column(mlp, "gate_proj", prefix, inter, tp, shards)
    column(mlp, "up_proj", prefix, inter, tp, shards)
    row(mlp, "down_proj", prefix, inter, tp, shards)


def shard_model(model: nn.Module, cfg, tp: TPContext) -> Shards:
    """Rewrite the (meta-device) model to rank `tp.rank`'s shapes; -> what to read of each split tensor
    (keyed by the model's own tensor names; the loader maps them to the checkpoint's)."""
    cfg.check_tensor_parallel(tp.size)
    shards: Shards = {}
    dtype = model.lm_head.weight.dtype
    backbone = model.model
    backbone.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp).to(dtype)
    shards["model.embed_tokens.weight"] = (0, *split(cfg.vocab_size, tp)[1:])
    model.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp).to(dtype)
    shards["lm_head.weight"] = (0, *split(cfg.vocab_size, tp)[1:])
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}."
        layer.self_attn.shard(p + "self_attn.", tp, shards)
        if isinstance(layer.mlp, MLP):
            _shard_mlp(layer.mlp, p + "mlp.", tp, shards)
        elif isinstance(layer.mlp, MoE) and isinstance(layer.mlp.shared_experts, MLP):
            _shard_mlp(layer.mlp.shared_experts, p + "mlp.shared_experts.", tp, shards)
        elif isinstance(layer.mlp, MoE) and isinstance(getattr(layer.mlp.shared_experts, "expert", None), MLP):
            # a gated shared expert: its MLP split, the per-token gate (a scalar) replicated
            _shard_mlp(layer.mlp.shared_experts.expert, p + "mlp.shared_experts.expert.", tp, shards)
    return shards
