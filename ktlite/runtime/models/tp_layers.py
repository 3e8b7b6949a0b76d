"""Tensor-parallel shards of the DeepSeek model: which slice of each weight a rank holds.

`shard_model(model, cfg, tp)` rewrites a model built on the meta device (before `to_empty`) to one
rank's shapes and returns the `Shards` map the loader slices by (`load_weights(..., shards=...)`),
so a rank never reads or holds a full tensor of a split weight. The split is the memory plan's
(`ktlite.runtime.memory`):

- MLA heads: q_proj / q_b_proj / kv_b_proj column-parallel (rank r keeps heads r*h/tp .. ), o_proj
  row-parallel (the matching input columns); q_a_proj, kv_a_proj_with_mqa and norms replicated,
  so every rank computes the same (full) latent.
- dense MLP and shared experts: gate/up column-parallel, down row-parallel, ceil(I/tp) per rank
  (the last rank zero-padded when I % tp != 0: silu(0) * 0 adds nothing).
- embeddings and lm_head vocab-parallel, ceil(vocab/tp) rows per rank.

Row-parallel outputs are partial sums: the runner all-reduces once after o_proj and once after
each MLP/MoE block (where the routed experts' part joins the shared experts' before the one
all-reduce). The vocab-parallel embedding all-reduces itself; the lm_head all-gathers the logits.
The reference modules are reused as they are (plain nn.Linear / FP8Linear with smaller shapes);
only `MLAttention.num_heads` changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ktlite.runtime.models.config import DeepseekConfig
from ktlite.runtime.models.deepseek import MLP, DeepseekForCausalLM, MLAttention
from ktlite.runtime.models.fp8 import FP8Linear

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


class VocabParallelLMHead(nn.Module):
    """ceil(vocab/tp) rows of lm_head; the logits of all ranks are gathered (every rank gets all)."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.weight = nn.Parameter(torch.empty(_ceil_div(vocab, tp.size), hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight))[..., : self.vocab]


def _resized(layer: nn.Module, in_features: int, out_features: int) -> nn.Module:
    if isinstance(layer, FP8Linear):
        return FP8Linear(in_features, out_features)
    return nn.Linear(in_features, out_features, bias=False, dtype=layer.weight.dtype)


def _split(total: int, tp: TPContext) -> tuple[int, int, int]:
    """(per-rank size, start, stop) of rank's ceil-sized part of `total` (stop clipped to total)."""
    size = _ceil_div(total, tp.size)
    start = min(tp.rank * size, total)
    return size, start, min(start + size, total)


def _column(parent: nn.Module, name: str, prefix: str, total_out: int, tp: TPContext, shards: Shards) -> None:
    layer = getattr(parent, name)
    size, start, stop = _split(total_out, tp)
    setattr(parent, name, _resized(layer, layer.in_features, size))
    shards[f"{prefix}{name}.weight"] = (0, start, stop)


def _row(parent: nn.Module, name: str, prefix: str, total_in: int, tp: TPContext, shards: Shards) -> None:
    layer = getattr(parent, name)
    size, start, stop = _split(total_in, tp)
    setattr(parent, name, _resized(layer, size, layer.out_features))
    shards[f"{prefix}{name}.weight"] = (1, start, stop)


def _shard_mlp(mlp: MLP, prefix: str, tp: TPContext, shards: Shards) -> None:
    inter = mlp.gate_proj.out_features
    _column(mlp, "gate_proj", prefix, inter, tp, shards)
    _column(mlp, "up_proj", prefix, inter, tp, shards)
    _row(mlp, "down_proj", prefix, inter, tp, shards)


def shard_model(model: DeepseekForCausalLM, cfg: DeepseekConfig, tp: TPContext) -> Shards:
    """Rewrite the (meta-device) model to rank `tp.rank`'s shapes; -> what to read of each split tensor."""
    heads = cfg.num_attention_heads
    if heads % tp.size:
        from ktlite.errors import ConfigError

        raise ConfigError(f"--tensor-parallel-size {tp.size}: the model's {heads} attention heads must split evenly")
    local = heads // tp.size
    shards: Shards = {}
    dtype = model.lm_head.weight.dtype
    backbone = model.model
    backbone.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp).to(dtype)
    shards["model.embed_tokens.weight"] = (0, *_split(cfg.vocab_size, tp)[1:])
    model.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp).to(dtype)
    shards["lm_head.weight"] = (0, *_split(cfg.vocab_size, tp)[1:])
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}."
        attn: MLAttention = layer.self_attn
        attn.num_heads = local
        a = p + "self_attn."
        q_name = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
        _column(attn, q_name, a, heads * cfg.qk_head_dim, tp, shards)
        _column(attn, "kv_b_proj", a, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), tp, shards)
        _row(attn, "o_proj", a, heads * cfg.v_head_dim, tp, shards)
        if isinstance(layer.mlp, MLP):
            _shard_mlp(layer.mlp, p + "mlp.", tp, shards)
        elif layer.mlp.shared_experts is not None:
            _shard_mlp(layer.mlp.shared_experts, p + "mlp.shared_experts.", tp, shards)
    return shards
