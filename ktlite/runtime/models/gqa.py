"""Grouped-query attention over the token pool, with the options the GQA families use.

Per layer the pool caches K and V per kv-head (`k`, `v`: [slots, kv_heads, head_dim]), rotated and
normalised as the model stores them; an FP8 pool (--kv-cache-dtype fp8_e4m3) packs each kv head's values
with their own fp32 scale (kv_fp8.head_rows: [slots, kv_heads, head_dim + 4] uint8), so nothing is clipped.
Options: bias on q/k/v (and on o), q/k RMSNorm per head (Qwen3, GLM) or over all heads together (MiniMax-M2's
`per_layer`), partial rotary, an output gate (q_proj emits a gate per head, the output is multiplied
by its sigmoid: Qwen3-Next), a learned sink logit per query head (`sinks`, gpt-oss) and a sliding window per
layer (`window`: the query at position p sees keys p - window + 1 .. p). The pool still caches every token of a
windowed layer (the attention kernels skip the keys outside the window).

Tensor parallelism: query heads (and their sinks) split evenly; kv heads split when there are at least as many as
ranks, else every rank computes all kv heads and keeps the one its query heads read (so the
per-layer k norm sees every head). A per-layer norm over split heads all-reduces its sum of squares. The o bias
is rank 0's (the ranks' outputs are summed): the other ranks hold zeros, so every rank has the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ktlite.errors import ConfigError
from ktlite.kernels import attention
from ktlite.kernels.triton.kv_fp8 import Fp8Rows, head_rows, packs_fp8
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.layers import RMSNorm
from ktlite.runtime.models.rope import RotaryEmbedding

QK_NORMS = (None, "per_head", "per_layer")


@dataclass(frozen=True)
class GQASpec:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    qk_norm: str | None = None
    output_gate: bool = False
    unit_offset_norms: bool = False

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def check_tensor_parallel(self, tp: int) -> None:
        if self.heads % tp:
            raise ConfigError(f"--tensor-parallel-size {tp}: the model's {self.heads} attention heads must split evenly")
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ConfigError(f"--tensor-parallel-size {tp}: the model's {self.kv_heads} kv heads neither split evenly "
                              f"over {tp} ranks nor replicate evenly")

    def local_kv_heads(self, tp: int) -> int:
        return self.kv_heads // tp if self.kv_heads >= tp else 1

    @property
    def fp8_rows(self) -> Fp8Rows:
        """One kv head's K or V in an FP8 pool: head_dim e4m3 codes and their fp32 scale (head_dim + 4 bytes)."""
        return head_rows(self.head_dim)

    def cache_specs(self, layers: tuple[int, ...], tp: int,
                    kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        """K and V per kv head in the pool's dtype, or in an FP8 pool as packed uint8 rows with their scales."""
        heads = self.local_kv_heads(tp)
        if packs_fp8(kv_dtype):
            shape, dtype = (heads, self.fp8_rows.row_bytes), torch.uint8
        else:
            shape, dtype = (heads, self.head_dim), None
        return [TokenCacheSpec("k", layers, shape, dtype), TokenCacheSpec("v", layers, shape, dtype)]

    def workspace(self, tp: int) -> int:
        """q (+ gate), k, v, attention output, o_proj input, per token per rank."""
        heads = self.heads // tp
        kv = self.kv_heads // tp if self.kv_heads >= tp else self.kv_heads  # replicated: all are computed
        return (heads * (2 if self.output_gate else 1) + 2 * kv + 2 * heads) * self.head_dim


class GQAttention(nn.Module):
    plan_component = "attention"

    def __init__(self, spec: GQASpec, rotary: RotaryEmbedding, window: int = 0):
        super().__init__()
        s = self.spec = spec
        self.rotary = rotary
        self.window = window  # 0: every earlier key; > 0: the last `window` keys
        self.num_heads, self.num_kv_heads = s.heads, s.kv_heads  # this rank's computed heads (TP shrinks them)
        self.kv_keep: tuple[int, int] | None = None  # TP replication: the kv heads this rank keeps
        self.tp = None
        q_out = s.heads * s.head_dim * (2 if s.output_gate else 1)
        self.q_proj = nn.Linear(s.hidden, q_out, bias=s.bias)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.bias)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.o_bias)
        # one logit per query head joining each softmax's denominator (adds nothing to the output)
        self.sinks = nn.Parameter(torch.empty(s.heads)) if s.sinks else None
        if s.qk_norm == "per_head":
            self.q_norm = RMSNorm(s.head_dim, s.eps, s.unit_offset_norms)
            self.k_norm = RMSNorm(s.head_dim, s.eps, s.unit_offset_norms)
        elif s.qk_norm == "per_layer":
            self.q_norm = RMSNorm(s.heads * s.head_dim, s.eps, s.unit_offset_norms)
            self.k_norm = RMSNorm(s.kv_heads * s.head_dim, s.eps, s.unit_offset_norms)

    def shard(self, prefix: str, tp, shards: dict) -> None:
        """Tensor parallel: query heads (and a per-layer q norm) split; kv heads split when there are at
        least as many as ranks, else computed whole on every rank, which keeps the head it reads."""
        from ktlite.runtime.models.tp_layers import column, row, split

        s, d = self.spec, self.spec.head_dim
        self.tp = tp
        self.num_heads = s.heads // tp.size
        column(self, "q_proj", prefix, self.q_proj.out_features, tp, shards)
        if s.qk_norm == "per_layer":
            _, lo, hi = split(s.heads * d, tp)
            self.q_norm = RMSNorm(hi - lo, s.eps, s.unit_offset_norms)
            shards[prefix + "q_norm.weight"] = (0, lo, hi)
        if s.kv_heads >= tp.size:
            self.num_kv_heads = s.kv_heads // tp.size
            for name in ("k_proj", "v_proj"):
                column(self, name, prefix, s.kv_heads * d, tp, shards)
            if s.qk_norm == "per_layer":
                _, lo, hi = split(s.kv_heads * d, tp)
                self.k_norm = RMSNorm(hi - lo, s.eps, s.unit_offset_norms)
                shards[prefix + "k_norm.weight"] = (0, lo, hi)
        else:
            keep = tp.rank * s.kv_heads // tp.size
            self.kv_keep = (keep, keep + 1)
        row(self, "o_proj", prefix, s.heads * d, tp, shards)
        if s.o_bias and tp.rank:  # the partial outputs are summed: rank 0 adds the bias, the others read none (zeros)
            shards[prefix + "o_proj.bias"] = (0, 0, 0)
        if s.sinks:
            _, lo, hi = split(s.heads, tp)
            self.sinks = nn.Parameter(torch.empty(hi - lo, dtype=self.sinks.dtype))
            shards[prefix + "sinks"] = (0, lo, hi)

    def _layer_norm(self, norm: RMSNorm, x: torch.Tensor, total_dim: int, split: bool) -> torch.Tensor:
        """RMSNorm over a vector whose values may be split over the ranks (then the sum of squares is)."""
        if not split or self.tp is None:
            return norm(x)
        sum_sq = x.float().pow(2).sum(-1, keepdim=True)
        mean_sq = self.tp.all_reduce(sum_sq) / total_dim
        return norm.scale(norm.normalize(x, mean_sq), x.dtype)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [N, hidden] -> q [N, heads, d], gate [N, heads * d] or None, k, v [N, kept kv heads, d]."""
        s, n = self.spec, h.shape[0]
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        gate = None
        if s.output_gate:  # q_proj interleaves per head: [q_h (d), gate_h (d)] for h in heads
            q, gate = q.view(n, self.num_heads, 2, s.head_dim).unbind(2)
            q, gate = q.reshape(n, -1), gate.reshape(n, -1)
        if s.qk_norm == "per_layer":
            q = self._layer_norm(self.q_norm, q, s.heads * s.head_dim, split=True)
            k = self._layer_norm(self.k_norm, k, s.kv_heads * s.head_dim, split=self.kv_keep is None)
        q, k, v = q.view(n, self.num_heads, s.head_dim), k.view(n, self.num_kv_heads, s.head_dim), v.view(n, self.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kv_keep is not None:
            lo, hi = self.kv_keep
            k, v = k[:, lo:hi], v[:, lo:hi]
        return self.rotary(q, cos, sin), gate, self.rotary(k, cos, sin), v

    def forward_batch(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx,
                      layer_idx: int) -> torch.Tensor:
        """h [N, hidden] -> this rank's partial output [N, hidden]."""
        pool = ctx.kv_pool
        q, gate, k, v = self.qkv(h, cos, sin)
        pool.write("k", layer_idx, batch.out_cache_loc, k, self.spec.fp8_rows)
        pool.write("v", layer_idx, batch.out_cache_loc, v, self.spec.fp8_rows)
        k_buf, v_buf = pool.buffer("k", layer_idx), pool.buffer("v", layer_idx)
        sinks = None if self.sinks is None else self.sinks.float()
        if batch.is_decode:
            o = attention.gqa_decode(q, k_buf, v_buf, pool.req_to_token, batch.req_pool_indices,
                                   batch.prefix_lens + 1, self.spec.scale, sinks=sinks, window=self.window)
        else:
            o = attention.gqa_extend(q, k_buf, v_buf, pool.req_to_token, batch.req_pool_indices,
                                   batch.prefix_lens, batch.extend_lens, self.spec.scale, sinks=sinks,
                                   window=self.window)
        o = o.flatten(-2)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def causal(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences h [B, T, hidden] at positions [B, T], causal, no cache -> [B, T, hidden]: plain torch
        (differentiable; tests train an MTP layer through it). No sinks or window (no MTP layer has them)."""
        if self.sinks is not None or self.window:
            raise NotImplementedError("GQAttention.causal: sinks and sliding windows are not supported")
        b, t, _ = h.shape
        cos, sin = self.rotary.cos_sin(positions.reshape(-1))
        q, gate, k, v = self.qkv(h.reshape(b * t, -1), cos, sin)  # [B T, heads, d]
        q, k, v = (x.view(b, t, x.shape[1], -1).transpose(1, 2) for x in (q, k, v))  # [B, heads, T, d]
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                             scale=self.spec.scale)
        o = o.to(h.dtype).transpose(1, 2).reshape(b * t, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o).view(b, t, -1)
