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

Kimi Delta Attention (`KimiDeltaAttention`, GLM-5.3-Flash's linear layers, transformers' `Glm5NextTextLinearAttention`)
is the same rule and state with a *per-channel* decay: g [N, heads, key_dim] instead of one value per head, from a
low-rank forget gate (`f_a_proj`, `f_b_proj`, + `dt_bias`) as `lower_bound * sigmoid(exp(A_log) * x)` (or
`-exp(A_log) * softplus(x)` without a bound); separate q / k / v projections (one head count, key_dim = value_dim),
each with its own depthwise conv (`q_conv1d`, `k_conv1d`, `v_conv1d`: run here as one conv over the three's
channels, fp32 weights as transformers keeps them); beta from `b_proj`; and the
output norm gated by sigmoid(`g_b_proj(g_a_proj(x))`) before `o_proj`. Both share `DeltaRuleAttention`: the forward
over the state pool, the speculative verify's rewind and the tensor-parallel split; only the projections, the decay
and the output differ.

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
    # Kimi Delta Attention: the per-channel decay's bound (lower_bound * sigmoid(...)); None: -exp(A_log) softplus
    decay_lower_bound: float | None = None

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
    """RMSNorm over each value head, then times act(gate): silu (Gated DeltaNet) or sigmoid (Kimi Delta Attention)."""

    plan_component = "norms_router"

    def __init__(self, dim: int, eps: float, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = F.silu if activation == "silu" else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * self.activation(gate.float())).to(x.dtype)


class DeltaRuleAttention(nn.Module):
    """What Gated DeltaNet and Kimi Delta Attention share: the conv + delta rule over the request's states in the state
    pool, the rewind after a speculative verify, the replicated tensor-parallel layout. A subclass gives `_split`
    (the projections), `_decay`, `_conv_weight` and `_output`."""

    plan_component = "attention"

    def __init__(self, spec: LinearAttentionSpec):
        super().__init__()
        self.spec = spec
        self.ranks = 1  # tensor-parallel ranks that compute this replicated layer
        # row -> (conv input, a, b) of its last verify's tokens, while a rewind may need them
        self._verified: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def shard(self, prefix: str, tp, shards: dict) -> None:
        self.ranks = tp.size

    def _split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, hidden] -> the conv input [N, channels] (q, k, v), the output gate, beta's and the decay's inputs."""
        raise NotImplementedError

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """The decay input -> log decay g <= 0, [N, Hv] or per key channel [N, Hv, dk]."""
        raise NotImplementedError

    def _conv_weight(self) -> torch.Tensor:
        """The depthwise conv's weight [channels, width]."""
        raise NotImplementedError

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The rule's output [N, Hv, dv] and the output gate -> [N, hidden]."""
        raise NotImplementedError

    def forward_batch(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx,
                      layer_idx: int) -> torch.Tensor:
        states = ctx.state_pool
        rows, lens, reset = batch.req_pool_indices, batch.extend_lens, batch.prefix_lens == 0
        mixed_in, z, b, a = self._split(h)
        if batch.drafts:
            self._before_verify(states, layer_idx, batch, mixed_in, a, b)
        mixed = attention.causal_conv1d(mixed_in, states.state("conv", layer_idx), self._conv_weight(), rows, lens,
                                        reset)
        q, k, v = self._heads(mixed)
        o = attention.gated_delta_rule(q, k, v, self._decay(a), b.float().sigmoid(), states.state("recurrent", layer_idx),
                                       rows, lens, reset)
        out = self._output(o, z)
        return out / self.ranks if self.ranks > 1 else out

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
        mixed = attention.causal_conv1d(mixed_in, conv, self._conv_weight(), one, lens, reset)
        q, k, v = self._heads(mixed)
        attention.gated_delta_rule(q, k, v, self._decay(a), b.float().sigmoid(), recurrent, one, lens, reset)


class GatedDeltaNet(DeltaRuleAttention):
    def __init__(self, spec: LinearAttentionSpec):
        super().__init__(spec)
        s = spec
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

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay <= 0

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(o, gate).reshape(o.shape[0], -1))


class KimiDeltaAttention(DeltaRuleAttention):
    """Kimi Delta Attention (see the module doc) under the checkpoints' names."""

    fp32_params = ("A_log", "dt_bias")  # fp32 in the checkpoints and in transformers, whatever the weights' dtype

    def __init__(self, spec: LinearAttentionSpec):
        super().__init__(spec)
        s = spec
        if s.key_heads != s.value_heads or s.key_dim != s.value_dim:
            raise ValueError("Kimi Delta Attention has one head count and key_dim == value_dim")
        width = s.key_heads * s.key_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(s.hidden, width, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, s.conv_width, groups=width, bias=False) for _ in range(3))
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.fp32_params = ("weight",)  # fp32 in transformers too (models.build keeps it)
        self.f_a_proj = nn.Linear(s.hidden, s.key_dim, bias=False)
        self.f_b_proj = nn.Linear(s.key_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(s.key_heads))
        self.b_proj = nn.Linear(s.hidden, s.key_heads, bias=False)
        self.g_a_proj = nn.Linear(s.hidden, s.key_dim, bias=False)
        self.g_b_proj = nn.Linear(s.key_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(s.value_dim, s.eps, activation="sigmoid")
        self.o_proj = nn.Linear(width, s.hidden, bias=False)

    def _split(self, h: torch.Tensor):
        """h [N, hidden] -> the conv input [N, 3 H d] as [q | k | v], the output gate [N, H, d], beta's input [N, H]
        and the forget gate's [N, H d] (before dt_bias)."""
        s, n = self.spec, h.shape[0]
        mixed = torch.cat((self.q_proj(h), self.k_proj(h), self.v_proj(h)), dim=-1)
        gate = self.g_b_proj(self.g_a_proj(h)).view(n, s.value_heads, s.value_dim)
        return mixed, gate, self.b_proj(h), self.f_b_proj(self.f_a_proj(h))

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """-> the per-channel log decay [N, H, dk]."""
        s = self.spec
        x = (a.float() + self.dt_bias.float()).view(-1, s.key_heads, s.key_dim)
        rate = self.A_log.float().exp().view(1, -1, 1)
        if s.decay_lower_bound is not None:
            return s.decay_lower_bound * torch.sigmoid(rate * x)
        return -rate * F.softplus(x)

    def _conv_weight(self) -> torch.Tensor:
        return torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)).squeeze(1)

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.o_norm(o, gate).reshape(o.shape[0], -1))
