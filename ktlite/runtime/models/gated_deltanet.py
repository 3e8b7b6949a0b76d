"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (transformers' `Qwen3NextGatedDeltaNet`,
`Qwen3_5MoeGatedDeltaNet`).

Per token: projections give q, k (per key head), v and the output gate z (per value head), beta and the decay
input a. Qwen3-Next fuses them in two, grouped per key head (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5 keeps four
(`in_proj_qkv` as [q | k | v], `in_proj_z`, `in_proj_b`, `in_proj_a`): `LinearAttentionSpec.split_projections`.
q, k, v go through a causal depthwise conv (width
`linear_conv_kernel_dim`, SiLU) that continues the request's rolling conv state; the gated delta rule
(`kernels.attention.gated_delta_rule`) reads and updates the request's recurrent state
[value heads, k_dim, v_dim]; a gated RMSNorm (norm, then times silu(z)) and `out_proj` follow. Both
states live in the state pool at the request's row and start from zeros at position 0.

The projections are linear layers like any other: a block-FP8 checkpoint's stay FP8 on the device
unless its `modules_to_not_convert` keeps them in bf16 (e.g. the small `in_proj_ba`, `in_proj_b`, `in_proj_a`).

Under tensor parallelism the layer is replicated (its weights are small next to the MoE); each rank
returns its output divided by the rank count, so the runner's all-reduce of partial sums restores it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ktlite.kernels import attention
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.state_cache import RequestStateSpec


@dataclass(frozen=True)
class LinearAttentionSpec:
    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    eps: float
    split_projections: bool = False  # Qwen3.5's four projections instead of Qwen3-Next's two fused ones

    @property
    def conv_channels(self) -> int:  # q, k and v go through the conv together
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_specs(self, layers: tuple[int, ...]) -> list[RequestStateSpec]:
        return [RequestStateSpec("conv", layers, (self.conv_channels, self.conv_width - 1)),
                RequestStateSpec("recurrent", layers, (self.value_heads, self.key_dim, self.value_dim))]

    def workspace(self) -> int:
        """Values per token held at once: the projections, the conv output, the rule's output."""
        kv = self.key_heads * self.key_dim
        vv = self.value_heads * self.value_dim
        return (2 * kv + 2 * vv + 2 * self.value_heads) + self.conv_channels + 2 * vv


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(gate)."""

    plan_component = "norms_router"

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    plan_component = "attention"

    def __init__(self, spec: LinearAttentionSpec):
        super().__init__()
        s = self.spec = spec
        self.ranks = 1  # tensor-parallel ranks that compute this replicated layer
        kv, vv = s.key_heads * s.key_dim, s.value_heads * s.value_dim
        if s.split_projections:
            self.in_proj_qkv = nn.Linear(s.hidden, s.conv_channels, bias=False)
            self.in_proj_z = nn.Linear(s.hidden, vv, bias=False)
            self.in_proj_b = nn.Linear(s.hidden, s.value_heads, bias=False)
            self.in_proj_a = nn.Linear(s.hidden, s.value_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(s.hidden, 2 * kv + 2 * vv, bias=False)
            self.in_proj_ba = nn.Linear(s.hidden, 2 * s.value_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_channels, s.conv_channels, s.conv_width, groups=s.conv_channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, s.eps)
        self.out_proj = nn.Linear(vv, s.hidden, bias=False)
        # row -> (conv input, a, b) of its last verify's tokens, while a rewind may need them
        self._verified: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def shard(self, prefix: str, tp, shards: dict) -> None:
        self.ranks = tp.size

    def _split(self, h: torch.Tensor):
        """h [N, hidden] -> the conv input [N, channels], z [N, Hv, dv], b, a [N, Hv]. Split projections give
        them as they are; fused ones are grouped per key head: [q, k, v of its value heads, z of its value heads]
        and [b..., a...]."""
        s, n = self.spec, h.shape[0]
        if s.split_projections:
            z = self.in_proj_z(h).view(n, s.value_heads, s.value_dim)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        per_key = s.value_heads // s.key_heads
        qkvz = self.in_proj_qkvz(h).view(n, s.key_heads, -1)
        q, k, v, z = qkvz.split([s.key_dim, s.key_dim, per_key * s.value_dim, per_key * s.value_dim], dim=-1)
        b, a = self.in_proj_ba(h).view(n, s.key_heads, 2 * per_key).split([per_key, per_key], dim=-1)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return mixed, z.reshape(n, s.value_heads, s.value_dim), b.reshape(n, -1), a.reshape(n, -1)

    def forward_batch(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx,
                      layer_idx: int) -> torch.Tensor:
        s, n, states = self.spec, h.shape[0], ctx.state_pool
        rows, lens, reset = batch.req_pool_indices, batch.extend_lens, batch.prefix_lens == 0
        mixed_in, z, b, a = self._split(h)
        if batch.drafts:
            self._before_verify(states, layer_idx, batch, mixed_in, a, b)
        mixed = attention.causal_conv1d(mixed_in, states.state("conv", layer_idx), self.conv1d.weight.squeeze(1),
                                        rows, lens, reset)
        q, k, v = self._heads(mixed)
        o = attention.gated_delta_rule(q, k, v, self._decay(a), b.float().sigmoid(), states.state("recurrent", layer_idx),
                                       rows, lens, reset)
        out = self.out_proj(self.norm(o, z).reshape(n, -1))
        return out / self.ranks if self.ranks > 1 else out

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay <= 0

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [N, channels] -> q, k [N, Hv, dk] (each key head repeated for its value heads), v."""
        s, n = self.spec, mixed.shape[0]
        kv = s.key_heads * s.key_dim
        q, k, v = mixed.split([kv, kv, s.value_heads * s.value_dim], dim=-1)
        per_key = s.value_heads // s.key_heads  # each key head serves this many value heads
        q = q.reshape(n, s.key_heads, s.key_dim).repeat_interleave(per_key, dim=1)
        k = k.reshape(n, s.key_heads, s.key_dim).repeat_interleave(per_key, dim=1)
        return q, k, v.reshape(n, s.value_heads, s.value_dim)

    # ---- speculative verifies: only the accepted tokens stay in a request's state -------------------------------
    def _before_verify(self, states, layer_idx: int, batch: ForwardBatch, mixed_in: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor) -> None:
        """Keep each drafting request's states in its verify row and its tokens' conv input, decay and beta
        inputs (`rewind` replays the accepted ones)."""
        self._verified.clear()
        starts = [0] + batch.extend_lens.cumsum(0).tolist()
        for i, row in enumerate(batch.req_pool_indices.tolist()):
            if batch.drafts[i]:
                for name in ("conv", "recurrent"):
                    state = states.state(name, layer_idx)
                    state[states.verify_row(row)].copy_(state[row])
                span = slice(starts[i], starts[i + 1])
                self._verified[row] = (mixed_in[span], a[span], b[span])

    def rewind(self, states, layer_idx: int, row: int, keep: int) -> None:
        """Request row `row`'s states as if only the first `keep` tokens of its last verify had run: its states
        from before the verify, advanced over those tokens again (conv window and delta rule)."""
        conv, recurrent = states.state("conv", layer_idx), states.state("recurrent", layer_idx)
        conv[row].copy_(conv[states.verify_row(row)])
        recurrent[row].copy_(recurrent[states.verify_row(row)])
        mixed_in, a, b = (t[:keep] for t in self._verified.pop(row))
        one = torch.tensor([row], device=mixed_in.device)
        lens, reset = torch.tensor([keep], device=mixed_in.device), torch.zeros(1, dtype=torch.bool,
                                                                                  device=mixed_in.device)
        mixed = attention.causal_conv1d(mixed_in, conv, self.conv1d.weight.squeeze(1), one, lens, reset)
        q, k, v = self._heads(mixed)
        attention.gated_delta_rule(q, k, v, self._decay(a), b.float().sigmoid(), recurrent, one, lens, reset)
