"""A decode step's MoE block on a CPU device in one compiled call, from the residual stream back to it.

Through the modules a MoE layer's block is the post-attention RMSNorm, the router (a matmul, softmax or sigmoid, the
group limits and top-k in torch), the routed experts' call with its routing arrays converted, the shared experts'
call and the residual add: at V2-Lite widths on a 2-core VM ~0.4 ms of Python and torch a layer and decode step,
more than the same operations cost alone, since they run with caches the experts' weights have just streamed
through. Here the same steps run inside one call (device_blocks.moe_block_rows), through the same expert and shared-expert
kernels (moe_rows_routed, swiglu_rows) on the same stored weights.

The modules are the spec and the tests' reference: RMSNorm (no unit offset), select_experts (routing
runtime/models/router.py's RouterSpec, as device_blocks.route_rows), CPUMoE.forward, the shared MLP's swiglu_rows. This
module hands the kernel its arrays; runtime/hybrid_moe.py decides when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from ktlite.errors import KtliteError
from ktlite.kernels.cpu import device_blocks
from ktlite.kernels.cpu.dense_linear import RowWeights

# no shared experts: matrices without rows (the kernel skips them), typed as an INT4 matrix's
_NO_SHARED: tuple[RowWeights, RowWeights] = tuple(
    (np.zeros((1, 0, 0), np.uint8), np.zeros((1, 0, 0), np.float32), 0, 0, False) for _ in range(2))
_NO_SKIP = np.zeros(0, np.bool_)  # every expert on the CPU: none skipped
_NO_BIAS = np.zeros(0, np.float32)


def residual_block(layer: int, norm: np.ndarray, eps: float, router: np.ndarray, bias: np.ndarray | None,
                   route: tuple, experts: tuple, shared: tuple[RowWeights, RowWeights] | None,
                   on_ids: Callable[[np.ndarray], None]) -> Callable:
    """A MoE layer's block as a compiled decode step's block (runtime/compiled_decode.py): x [T, hidden] fp32 ->
    x + the routed and shared experts of RMSNorm(x). norm: the layer's post-attention RMSNorm weight; router
    [E, hidden] fp32 and its correction bias (None without); route: the RouterSpec as device_blocks.route_rows takes it
    (router.route_args); experts: CPUMoE.decode_experts; shared: the shared MLP's (gate_up, down) row weights, None
    without shared experts; on_ids: called with each step's chosen expert ids [T, k]."""
    gate_up, down = _NO_SHARED if shared is None else shared
    fixed = (norm, np.float32(eps), router, _NO_BIAS if bias is None else bias, route, _NO_SKIP, experts, gate_up, down,
             numba.config.NUMBA_NUM_THREADS)

    def run(x: np.ndarray, step: tuple) -> np.ndarray:
        out, ids, missing = device_blocks.moe_block_rows(x, *fixed)
        if missing >= 0:  # cannot happen where the CPU holds every expert, as it does here
            raise KtliteError(f"layer {layer}: the router chose expert {missing}, which the CPU store does not hold")
        on_ids(ids)
        return out
    return run


__all__ = ["residual_block"]
