"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 plus DeepSeek Sparse Attention (DSA).

A lightning indexer per layer scores every cached token for each query
(`sum_h w_h * relu(q_h . k) / sqrt(d)`, q from `wq_b` on the q_lora residual, k from `wk` + LayerNorm,
half-split rope on the first qk_rope_head_dim values of both), and the MLA attention then reads only
each query's top `index_topk` tokens (causal). The indexer's per-token key (`index_head_dim` values
per layer) is cached in the token pool beside the MLA latent ("index_key"), so it is planned,
reference-counted and freed with it; an FP8 pool stores it as fp8 values with one fp32 scale. Tensor
parallelism replicates the indexer (its weights and keys are small next to the latent heads).

The indexer hands the attention each new token's selected pool slots ([N, index_topk], -1 padded,
causal), so decode and extend are one `sparse_mla` call; it equals dense MLA when top-k covers
every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ktlite.errors import ConfigError
from ktlite.kernels.attention import sparse_mla
from ktlite.kernels.triton.kv_fp8 import Fp8Rows, is_packed
from ktlite.kernels.triton.reference import causal_mask, request_spans
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models import deepseek_config
from ktlite.runtime.models.base import CausalLM
from ktlite.runtime.models.deepseek import DeepseekForCausalLM, MLAttention
from ktlite.runtime.models.deepseek_config import DeepseekConfig
from ktlite.runtime.models.rope import RotaryEmbedding, apply_rope

ARCHITECTURES = ("DeepseekV32ForCausalLM",)
MODEL_TYPES = ("deepseek_v32",)


@dataclass(frozen=True)
class DeepseekV32Config(DeepseekConfig):
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    index_rope_interleave: bool = False  # V3.2's indexer rotates halves; GLM-5's adjacent pairs
    # layers that reuse the previous indexed layer's selection instead of running an indexer (GLM-5)
    shared_index_layers: tuple[int, ...] = ()

    @property
    def indexed_layers(self) -> tuple[int, ...]:
        """Layers running their own indexer (a served MTP layer's included: it has one, as SGLang builds it)."""
        return tuple(i for i in self.decoder_and_mtp_layers if i not in self.shared_index_layers)

    @property
    def is_v3(self) -> bool:  # V3's routing and defaults
        return True

    def fp8_rows(self, name: str) -> Fp8Rows:
        """In an FP8 pool an index key is its fp8 values with one fp32 scale (132 bytes at dim 128)."""
        return Fp8Rows(self.index_head_dim, self.index_head_dim) if name == "index_key" else super().fp8_rows(name)

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        return super().token_cache_specs(tp_size, kv_dtype) + [
            self.cache_spec("index_key", self.indexed_layers, self.index_head_dim, kv_dtype)]

    def attention_workspace(self, tp_size: int) -> int:
        """MLA's, plus the indexer's q, k, head weights and one row of scores per head (over a chunk's
        worth of keys this is an underestimate for long prefixes; the torch path scores per request)."""
        return super().attention_workspace(tp_size) + (self.index_n_heads + 1) * self.index_head_dim + 2 * self.index_n_heads


def parse_config(raw: dict[str, Any]) -> DeepseekV32Config:
    """The V3 fields (V3 defaults) plus the indexer's."""
    base = deepseek_config.parse_config({**raw, "architectures": [deepseek_config.ARCHITECTURES[1]]})
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return DeepseekV32Config(**{**fields, "architecture": ARCHITECTURES[0]},
                             index_n_heads=int(raw.get("index_n_heads", 64)),
                             index_head_dim=int(raw.get("index_head_dim", 128)),
                             index_topk=int(raw.get("index_topk", 2048)))


INDEX_SCORE_BYTES = 64 << 20  # the [tokens, heads, keys] fp32 scores held at once: keys go in tiles that fit


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, d], head weights w [n, H], keys [t, d] (fp32) -> [n, t] = sum_h w[:, h] * relu(q[:, h] . k x scale),
    over tiles of keys, so the per-head scores never exist whole (a 512-token chunk's 64 heads over 16k cached
    tokens would be 2 GiB)."""
    n, heads, _ = q.shape
    tile = max(1, INDEX_SCORE_BYTES // (4 * n * heads))
    out = torch.empty(n, keys.shape[0], dtype=torch.float32, device=q.device)
    q_rows = q.reshape(n * heads, -1)
    for lo in range(0, keys.shape[0], tile):
        scores = torch.relu(q_rows @ keys[lo : lo + tile].T * scale).view(n, heads, -1)
        out[:, lo : lo + tile] = torch.bmm(w.unsqueeze(1), scores).squeeze(1)
    return out


class Indexer(nn.Module):
    plan_component = "attention"
    fp8_linears = ("wq_b", "wk")  # FP8 checkpoints keep weights_proj in high precision

    def __init__(self, cfg: DeepseekV32Config):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def key(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] -> the cached index key [N, index_head_dim]."""
        return apply_rope(self.k_norm(self.wk(h)), cos, sin, self.cfg.index_rope_interleave)

    def top_slots(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: ForwardBatch, keys: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
        """[N, index_topk] pool slots each new token attends to: its causal top-k by index score, -1 where
        fewer tokens exist (the form the sparse attention kernels take)."""
        c = self.cfg
        q = apply_rope(self.wq_b(q_resid).view(-1, c.index_n_heads, c.index_head_dim), cos.unsqueeze(-2),
                       sin.unsqueeze(-2), c.index_rope_interleave)
        w = self.weights_proj(h).float() * c.index_n_heads**-0.5  # [N, H]
        out = torch.full((h.shape[0], c.index_topk), -1, dtype=torch.int64, device=h.device)
        for row, prefix, n, start in request_spans(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens):
            slots = req_to_token[row, : prefix + n].long()
            k = c.fp8_rows("index_key").unpack(keys[slots]) if is_packed(keys) else keys[slots].float()
            index = index_scores(q[start : start + n].float(), w[start : start + n], k, c.index_head_dim**-0.5)
            index.masked_fill_(~causal_mask(prefix, n, h.device), float("-inf"))
            best = index.topk(min(c.index_topk, prefix + n), dim=-1)
            chosen = slots[best.indices].masked_fill(best.values == float("-inf"), -1)  # future tokens: none
            out[start : start + n, : chosen.shape[1]] = chosen
        return out


class SparseMLAttention(MLAttention):
    """MLA over the slots its indexer selects. A layer without an indexer (`shared_index_layers`)
    reuses the slots the last indexed layer selected in the same forward."""

    def __init__(self, cfg: DeepseekV32Config, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        self.indexer: Indexer | None = Indexer(cfg)
        # (the indexed layer whose selection this one reuses,): a tuple, so torch does not register
        # that layer as a submodule a second time
        self.reuses: tuple[SparseMLAttention, ...] = ()
        self.last_slots: torch.Tensor | None = None

    def causal(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences x [B, T, hidden] at positions [B, T], no cache (differentiable but for the selection): each
        query attends to the top index_topk of its causal keys by its own indexer, as served (MTPLayer.forward)."""
        if self.indexer is None:
            raise NotImplementedError("SparseMLAttention.causal: a layer reusing another layer's selection")
        c, (b, t, _) = self.cfg, x.shape
        cos, sin = self.rotary.cos_sin(positions)
        q_resid = self.q_a_layernorm(self.input_projections(x)[0])
        q = apply_rope(self.indexer.wq_b(q_resid).view(b, t, c.index_n_heads, c.index_head_dim), cos.unsqueeze(-2),
                       sin.unsqueeze(-2), c.index_rope_interleave)
        w = self.indexer.weights_proj(x).float() * c.index_n_heads**-0.5  # [B, T, H]
        keys = self.indexer.key(x, cos, sin).float()  # [B, T, index_head_dim]
        keep = torch.zeros(b, t, t, dtype=torch.bool, device=x.device)
        for i in range(b):
            index = index_scores(q[i].float(), w[i], keys[i], c.index_head_dim**-0.5)
            index.masked_fill_(~causal_mask(0, t, x.device), float("-inf"))
            keep[i].scatter_(1, index.topk(min(c.index_topk, t), dim=-1).indices, True)  # future keys: causality's
        return self(x, positions, None, 0, absorbed=False, keep=keep)

    def compiled_residual(self, *args) -> None:
        """None: MLA's compiled block attends to every token and writes no index keys (forward_batch runs)."""
        return None

    def forward_batch(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx,
                      layer_idx: int) -> torch.Tensor:
        c, pool = self.cfg, ctx.kv_pool
        q_in, kv_in = self.input_projections(h)
        self.store(pool, "latent", layer_idx, batch.out_cache_loc, self.latent(kv_in, cos, sin))
        q_resid = self.q_a_layernorm(q_in)
        q = self.q_b_proj(q_resid).view(*h.shape[:-1], self.num_heads, c.qk_head_dim)
        if self.indexer is None:
            slots = self.reuses[0].last_slots
        else:
            self.store(pool, "index_key", layer_idx, batch.out_cache_loc, self.indexer.key(h, cos, sin))
            slots = self.last_slots = self.indexer.top_slots(h, q_resid, cos, sin, batch,
                                                             pool.buffer("index_key", layer_idx), pool.req_to_token)
        o = sparse_mla(self.absorbed_query(q, cos, sin), pool.buffer("latent", layer_idx), slots, c.softmax_scale,
                       c.kv_lora_rank)
        return self.output(o)


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    """The reference call runs the batched sparse forward over a private pool (base.CausalLM's)."""

    attention_class = SparseMLAttention
    forward = CausalLM.forward
    new_cache = CausalLM.new_cache

    def __init__(self, cfg: DeepseekV32Config, routed_experts: bool = True):
        super().__init__(cfg, routed_experts)
        source = None
        for layer in self.model.layers:
            if layer.layer_idx in cfg.shared_index_layers:
                if source is None:
                    raise ConfigError(f"config.json: layer {layer.layer_idx} reuses the index selection of an earlier "
                                      "indexed layer, but no earlier layer has an indexer")
                layer.self_attn.indexer, layer.self_attn.reuses = None, (source,)
            else:
                source = layer.self_attn


Model = DeepseekV32ForCausalLM

# `ktlite tiny-model --arch deepseek_v32`: V3's tiny shapes plus a small indexer (top-k below the
# prompt lengths the tests use, so the sparsity is exercised). 16 index heads: with few heads, keys
# whose ReLU scores are 0 in every head tie, and top-k's choice among ties is arbitrary.
TINY_CONFIGS = {"deepseek_v32": {
    **deepseek_config.TINY_CONFIGS["deepseek_v3"],
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 6,
}}
