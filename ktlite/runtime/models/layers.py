"""Layers every family shares: RMSNorm, the SwiGLU MLP, the router and the MoE block.

Modules carry a `plan_component` tag naming the memory-plan component their parameters count
against (see `ktlite.runtime.memory.components_of`): the outermost tagged module wins, so the MLP of a
shared expert counts as "shared_experts", except that a norm or router counts as "norms_router"
wherever it sits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktlite.kernels.cpu.dense_linear import swiglu_rows
from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation
from ktlite.runtime.models.config import RouterSpec
from ktlite.runtime.models.router import select_experts


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`; with `unit_offset` the stored weight is w - 1 (Qwen3-Next's `(1 + w)` form)."""

    plan_component = "norms_router"

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def normalize(self, x: torch.Tensor, mean_square: torch.Tensor | None = None) -> torch.Tensor:
        """x in float32 scaled by 1/rms; `mean_square` [..., 1] overrides x's own (a norm whose
        vector is split over tensor-parallel ranks passes the global one)."""
        xf = x.float()
        if mean_square is None:
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        return xf * torch.rsqrt(mean_square + self.eps)

    def scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.unit_offset:  # this form scales in float32 before casting back
            return (normed * (1.0 + self.weight.float())).to(dtype)
        return self.weight * normed.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not self.unit_offset:
            # the same products in one call (a CPU device's fp32 decode: ~14 -> ~9 us a norm, 17 norms a step)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.scale(self.normalize(x), x.dtype)


def plain_norm(norm: nn.Module) -> bool:
    """Whether norm is an fp32 RMSNorm without unit offset: the compiled blocks' (device_blocks.rms_scaled)."""
    return isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32 and not norm.unit_offset


class MLP(nn.Module):
    """Gated MLP: dense layers, each routed expert and the shared experts. `activation`: SiLU(gate) * up, or a
    family's clamped variant (kernels/expert_activation.py, e.g. MiniMax-M3's swiglu_oai in every MLP)."""

    plan_component = "dense_mlp"
    # gate and up read the same input: a CPU device stores them as one matrix (cpu_dense.py), one kernel call
    fused_linears = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int, activation: ExpertActivation = SWIGLU):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            # a CPU device's decode: one call (its kernel computes SiLU(gate) * up only)
            compiled = swiglu_rows(x, self.gate_up_proj, self.down_proj) if self.activation.plain else None
            if compiled is not None:
                return compiled
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate, up))


class Router(nn.Module):
    """fp32 router weight [E, hidden] (+ the logit bias and the correction bias when the spec has them)."""

    plan_component = "norms_router"

    def __init__(self, spec: RouterSpec, hidden: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts, dtype=torch.float32)) if spec.logit_bias else None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> topk_ids [N, k], topk_weights [N, k] (router math in float32)."""
        logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return select_experts(logits, self.spec, self.e_score_correction_bias)


class MoE(nn.Module):
    """Router + routed experts + shared expert(s). Without `routed_experts` the expert weights are left
    out: the runtime keeps them elsewhere (CPU store, GPU expert buffers) and runs them itself
    (`HybridMoE` reads `gate`, `shared_experts`, `activation` and `expert_biases()`)."""

    activation: ExpertActivation = SWIGLU  # the routed experts' (kernels/expert_activation.py)

    def __init__(self, spec: RouterSpec, hidden: int, expert_intermediate: int, shared_intermediate: int,
                 routed_experts: bool = True, activation: ExpertActivation = SWIGLU):
        super().__init__()
        self.activation = activation  # the routed and the shared experts'
        self.gate = Router(spec, hidden)
        count = spec.num_experts if routed_experts else 0
        self.experts = nn.ModuleList(MLP(hidden, expert_intermediate, activation) for _ in range(count))
        for expert in self.experts:
            expert.plan_component = "gpu_experts"  # a routed expert on the device is a GPU expert
        self.shared_experts = MLP(hidden, shared_intermediate, activation) if shared_intermediate else None
        if self.shared_experts is not None:
            self.shared_experts.plan_component = "shared_experts"

    def expert_biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed experts' biases (gate_up [E, 2I] gate then up, down [E, H]), or None: they have none."""
        return None

    def routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]: sum over each token's chosen experts of weight * expert(x)."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            token_idx, slot = (topk_ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token_idx]).float() * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        topk_ids, topk_weights = self.gate(flat)
        out = self.routed(flat, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)
