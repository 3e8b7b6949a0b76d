"""The gated activation of a routed expert, between its gate/up projection and its down projection.

One formula covers the families' variants, so every expert kernel (CPU rows and matmul paths, the GPU fused MoE and
its torch twin) takes the same three numbers:

    g = min(gate, limit);  u = clamp(up, -limit, limit)
    act = g * sigmoid(alpha * g) * (u + up_offset)

- "swiglu" (DeepSeek, Qwen, GLM, MiniMax): alpha 1, no limit, offset 0: SiLU(gate) * up. DeepSeek-V4's clamped
  SwiGLU (`swiglu_limit`) is this kind with a limit.
- "swiglu_oai" (gpt-oss): alpha 1.702, limit 7, offset 1 (`(clamp(up) + 1) * g * sigmoid(1.702 g)`).
A gate/up bias, where a family has one, is added to the projection before the activation (the kernels take it per
expert next to the activation); a down bias after the down projection, weighted like the rest of the expert's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("swiglu", "swiglu_oai")
NO_LIMIT = 3.0e38  # the clamp of an activation without a limit: past any fp32 activation, finite (fastmath kernels)


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "swiglu"
    limit: float | None = None  # None: no clamp
    alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"expert activation {self.kind!r}: one of {KINDS}")

    @property
    def up_offset(self) -> float:
        return 1.0 if self.kind == "swiglu_oai" else 0.0

    @property
    def plain(self) -> bool:
        """SiLU(gate) * up exactly: what kernels without these parameters compute (AMX / VNNI tiles)."""
        return self.kind == "swiglu" and self.limit is None and self.alpha == 1.0

    def params(self) -> tuple[np.float32, np.float32, np.float32]:
        """(alpha, limit, up_offset) as the kernels take them (NO_LIMIT: no clamp)."""
        limit = NO_LIMIT if self.limit is None else self.limit
        return np.float32(self.alpha), np.float32(limit), np.float32(self.up_offset)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of gate, up (same shape), in their dtype."""
        if self.plain:
            return torch.nn.functional.silu(gate) * up
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + self.up_offset)


SWIGLU = ExpertActivation()
