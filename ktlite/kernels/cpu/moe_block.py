"""A decode step's MoE block on a CPU device in one compiled call, from the residual stream back to it.

Through the modules a MoE layer's block is the post-attention RMSNorm, the router (a matmul, softmax or sigmoid, the
group limits and top-k in torch), the routed experts' call with its routing arrays converted, the shared experts'
call and the residual add: at V2-Lite widths on a 2-core VM ~0.4 ms of Python and torch a layer and decode step,
more than the same operations cost alone, since they run with caches the experts' weights have just streamed
through. Here the same steps run inside one call (kernels.moe_block_rows), through the same expert and shared-expert
kernels (moe_rows_routed, swiglu_rows) on the same stored weights.

The modules are the spec and the tests' reference: RMSNorm (no unit offset), select_experts (routing
runtime/models/router.py's RouterSpec, as kernels.route_rows), CPUMoE.forward, the shared MLP's swiglu_rows. This
module hands the kernel its arrays; runtime/hybrid_moe.py decides when it runs.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ktlite.kernels.cpu import kernels
from ktlite.kernels.cpu.dense_linear import RowWeights
from ktlite.kernels.triton import forced_torch

# no shared experts: matrices without rows (the kernel skips them), typed as an INT4 matrix's
_NO_SHARED: tuple[RowWeights, RowWeights] = tuple(
    (np.zeros((1, 0, 0), np.uint8), np.zeros((1, 0, 0), np.float32), 0, 0, False) for _ in range(2))
_NO_SKIP = np.zeros(0, np.bool_)  # every expert on the CPU: none skipped
_NO_BIAS = np.zeros(0, np.float32)


def runs(x: torch.Tensor) -> bool:
    """Whether the compiled block can take the residual stream x: few fp32 tokens [T, hidden] on a CPU device, and
    KTLITE_FORCE_TORCH_KERNELS not set (the callers check their weights: CPUMoE.decode_experts, swiglu_weights)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and not forced_torch()


def moe_decode_block(x: np.ndarray, norm: np.ndarray, eps: float, router: np.ndarray, bias: np.ndarray | None,
                     route: tuple, experts: tuple,
                     shared: tuple[RowWeights, RowWeights] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """x [T, hidden] fp32 -> (x + routed + shared experts of RMSNorm(x), ids [T, k], weights [T, k], missing).
    norm: the RMSNorm weight; router [E, hidden] fp32 and its correction bias (None without); route: the RouterSpec
    as kernels.route_rows takes it (router.route_args); experts: CPUMoE.decode_experts; shared: the shared MLP's
    (gate_up, down) row weights, None without shared experts. missing >= 0: an expert the CPU store does not hold
    (x comes back unchanged; the caller's module path raises, naming it)."""
    gate_up, down = _NO_SHARED if shared is None else shared
    return kernels.moe_block_rows(x, norm, np.float32(eps), router, _NO_BIAS if bias is None else bias, route,
                                  _NO_SKIP, experts, gate_up, down, numba.config.NUMBA_NUM_THREADS)


__all__ = ["moe_decode_block", "runs"]
