"""GPU-side kernels and their dispatch: Triton on CUDA tensors, the plain-torch twin elsewhere.

The runtime calls fused_moe / fp8_linear and never picks an implementation itself (attention kinds have their
own interface, ktlite/kernels/attention.py, which uses use_triton/forced_torch below for the same rule):
- tensors on CUDA -> Triton kernel;
- TRITON_INTERPRET=1 -> Triton kernel run by the interpreter on CPU tensors (tests);
- otherwise (CPU, no interpreter) -> torch twin, chosen without touching Triton: a launch there
  would raise "0 active drivers";
- KTLITE_FORCE_TORCH_KERNELS=1 -> always the twin (debugging), and a CPU device's decode runs its modules one by
  one instead of the compiled blocks (kernels/cpu/mla_block.py, dense_linear.swiglu_rows).
Kernel modules are imported on first Triton use, so importing this package never needs a GPU.
Note triton.jit decides "interpreted or compiled" when a kernel module is first imported: set
TRITON_INTERPRET before the first Triton call in a process, not in between.
"""

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation
from ktlite.kernels.triton.quant import QuantizedWeight, dequantize_expert, quantize_weight
from ktlite.kernels.triton.reference import fp8_dequantize, fp8_linear_torch, fused_moe_torch

logger = logging.getLogger(__name__)

__all__ = [
    "QuantizedWeight",
    "dequantize_expert",
    "fp8_dequantize",
    "forced_torch",
    "fp8_linear",
    "fused_moe",
    "interpreted",
    "quantize_weight",
    "use_triton",
]


def forced_torch() -> bool:
    return os.environ.get("KTLITE_FORCE_TORCH_KERNELS", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether a call on tensor t goes to the Triton kernel (rules in the module docstring)."""
    if forced_torch():
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels(name: str) -> ModuleType:
    return importlib.import_module(f"ktlite.kernels.triton.{name}")


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Set TRITON_INTERPRET=1 inside the block, then restore it. Tests import the kernel modules
    and run them inside it (triton reads the variable both at decoration and at launch), so other
    CPU calls in the same process, e.g. other tests' models, keep using the fast twins."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
    activation: ExpertActivation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts on this device. hidden [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I] (dense bf16/fp16 or QuantizedWeight INT8/INT4), topk_ids/topk_weights [T, k],
    expert_mask [E] bool (True = computed here) -> [T, H] in hidden's dtype. Ids outside [0, E)
    (e.g. -1) are skipped like masked ones, so a compact stack of just this device's experts with
    remapped ids works without a mask. activation: the experts' gated activation (SiLU(gate) * up by default);
    biases: (gate_up [E, 2I], down [E, H]) indexed as w13 / w2, or None."""
    if use_triton(hidden):
        return _kernels("moe").fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, expert_mask, activation,
                                                biases)
    return fused_moe_torch(hidden, w13, w2, topk_ids, topk_weights, expert_mask, activation, biases)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] float8_e4m3fn * 128x128 block scale_inv [ceil(N/128), ceil(K/128)])^T
    + bias -> [M, N] in x's dtype. On CUDA, w8a8 on GPUs with FP8 MMA (sm89+), else weight-only."""
    if use_triton(x):
        return _kernels("fp8").fp8_linear_triton(x, weight, weight_scale_inv, bias)
    return fp8_linear_torch(x, weight, weight_scale_inv, bias)
