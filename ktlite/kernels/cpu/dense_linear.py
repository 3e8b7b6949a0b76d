"""QuantizedLinear: a Linear layer whose weight is stored group-wise INT8/INT4 (quant.py) and run by the CPU
expert kernels; the device-side layers of a CPU-only run (ktlite/runtime/cpu_dense.py swaps them in).
QuantizedHeads, its base: a stack of such matrices applied per head (MLA's W_UK / W_UV).

`y [..., N] = x [..., K] @ W.T (+ bias)` in x's dtype, W the stored (dequantized) values. Two paths, chosen
by the token count T at the crossover of a CPU expert (moe.default_prefill_threshold: the trade-off is the
same, one matrix shared by T tokens):
- few tokens (decode): linear_kernels.linear_rows, vector row dots straight from the stored bytes, fp32 math (or
  integer dots with int8 activations, `int8_activations`), each weight read from RAM once per call;
- on a CPU with AMX (int8 activations, groups of >= 64), from where the matmul path takes over without AMX up to
  the experts' AMX crossover (moe.Q8_AMX_PREFILL_THRESHOLD) for bf16 inputs, AMX_FP32_GEMM_TOKENS for fp32 ones:
  amx_kernels.linear_amx, the experts' AMX tiles (2-4.7x linear_rows' speed, 1.6-21x the matmul path's at 32-128
  tokens, 2.1-3.3x its fp32 GEMM at 512). Not below that: AMX quantizes the activations
  per weight group, the row dots per 32 values, and the row dots' results do not depend on how many tokens share
  the call (a prompt's tokens, one decode token), which greedy outputs across prefix-cache hits rely on;
- more tokens (prefill): gemm.stored_matmul dequantizes tiles of at most TILE_WEIGHTS weights (into bf16
  where oneDNN's bf16 GEMM beats its fp32 one, for bf16 x and, with int8 activations, fp32 x; else fp32:
  QuantizedHeads.matmul_dtype) and multiplies with torch (oneDNN),
  several times faster per token than the kernel's fp32 row dots once the dequantization is shared by
  enough tokens.

The few-token path is one kernel call that pads and quantizes x itself (each Python-side numpy step cost
a few microseconds, ~50 calls per decode step). The matmul path's scratch (row buffers, the dequantized
tile) lives in one DenseWorkspace per model that every QuantizedLinear / QuantizedHeads shares, one set per calling
thread, grown to the largest call and reused.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable

import numba
import numpy as np
import torch
from torch import nn

from ktlite.kernels.cpu import amx_kernels, amx_tiles, device_blocks, gemm, linear_kernels
from ktlite.kernels.cpu.moe import Q8_AMX_PREFILL_THRESHOLD, default_prefill_threshold
from ktlite.kernels.cpu.quant import INT_DOT_METHODS, QuantizedWeight, dequantize, quantize
from ktlite.kernels.cpu.target import bf16_gemm_wins
from ktlite.kernels.triton import forced_torch

# weights per dequantized tile of the matmul path: bounds its buffer (16 MiB in fp32), where a whole
# 129,280-row lm_head of hidden 7168 would take 3.7 GB
TILE_WEIGHTS = 1 << 22
# fp32 inputs (a CPU-only run's default dtype) go to the AMX tiles up to this many tokens, where the matmul path
# would run oneDNN's fp32 GEMM: INT4 3072 x 2048 / 2048 x 1408 matrices on Sapphire Rapids (2 cores), AMX 2.7x /
# 2.1x faster at 512 tokens, 1.3x / 1.2x at 4096, 0.94x (2048 x 1408) at 8192
AMX_FP32_GEMM_TOKENS = 4096


# one stored matrix stack as the row-dot kernel takes it (QuantizedHeads.row_weights, linear_kernels.project_rows):
# (qweight [G, N, ·], scales [G, N, ·], group_shift, kp, q8)
RowWeights = tuple[np.ndarray, np.ndarray, int, int, bool]


class _Scratch:
    """One calling thread's reusable buffers, by name; each grows to the largest size asked for."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        # the device side's threads: as many numba threads on this thread as torch's intra-op pool has
        # (tensor-parallel ranks run torch with one thread each, so their kernels do not oversubscribe)
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))

    def array(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        size = math.prod(shape)
        buf = self._arrays.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._arrays[name] = np.empty(size, dtype)
        return buf[:size].reshape(shape)

    def tensor(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._tensors.get(name)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = self._tensors[name] = torch.empty(size, dtype=dtype)
        return buf[:size]


class DenseWorkspace:
    """Scratch shared by the QuantizedLinear layers of one model, one set of buffers per calling thread."""

    def __init__(self):
        self._threads: dict[int, _Scratch] = {}

    def scratch(self) -> _Scratch:
        key = threading.get_ident()
        found = self._threads.get(key)
        if found is None:
            found = self._threads[key] = _Scratch()
        return found


class QuantizedHeads(nn.Module):
    """Stacked matrices `W [G, N, K]` stored group-wise INT8/INT4, each applied to its own slice of the input:
    `y [..., G, N]`, `y[..., g, :] = x[..., g, :] @ W_g.T`, in x's dtype. MLA's per-head W_UK / W_UV on a
    CPU device (cpu_dense.py), and with G = 1 the base of QuantizedLinear."""

    def __init__(self, weight: QuantizedWeight, workspace: DenseWorkspace | None = None, int8_activations: bool = False):
        super().__init__()
        if weight.qweight.ndim != 3:
            raise ValueError(f"QuantizedHeads takes stacked [G, N, K] matrices, got shape {weight.shape}")
        self.stack = weight
        self.heads, self.out_features, self.in_features = weight.shape
        # buffers sharing the stored arrays' memory, so the memory plan's byte count sees them
        self.register_buffer("qweight", torch.from_numpy(weight.qweight), persistent=False)
        self.register_buffer("scales", torch.from_numpy(weight.scales), persistent=False)
        self.workspace = workspace or DenseWorkspace()
        self.int8_activations = int8_activations  # the few-token path dots int8 activations (int8_dots.row_dot_q8)
        self._q8 = int8_activations and weight.method in INT_DOT_METHODS
        # what the row-dot kernel takes besides input and output (kept here for a compiled caller: mla_block)
        self.row_weights: RowWeights = (weight.qweight, weight.scales, weight.group_shift, weight.kp, self._q8)
        # tokens from which the row dots stop (and, without AMX, the matmul path wins), by the dtype it would run in
        self.rows_tokens = {dt: default_prefill_threshold(weight.method, dt, int8_activations)
                            for dt in (torch.bfloat16, torch.float32)}
        amx = (self._q8 and amx_tiles.AMX and self.out_features >= amx_tiles.AMX_BLOCK_ROWS
               and weight.group_size >= amx_tiles.AMX_MIN_GROUP)  # as for an expert's matrices (moe.amx_fits)
        # tokens from which the matmul path wins: after the AMX tiles where they run (against oneDNN's bf16 GEMM as
        # for the experts, its fp32 one much later), else after the row dots
        if amx:
            amx_until = {torch.bfloat16: Q8_AMX_PREFILL_THRESHOLD[weight.method], torch.float32: AMX_FP32_GEMM_TOKENS}
            self.gemm_tokens = {dt: max(n, amx_until[dt]) for dt, n in self.rows_tokens.items()}
        else:
            self.gemm_tokens = dict(self.rows_tokens)
        # whether the AMX tiles sum whole rows (INT4 scales folding into the weights, amx_kernels.fold_steps)
        self._steps = amx_kernels.fold_steps(weight.scales) if amx and weight.method == "INT4" else amx_kernels.NO_STEPS

    @classmethod
    def from_matrices(cls, w: torch.Tensor, method: str, group_size: int | None,
                      workspace: DenseWorkspace | None = None,
                      int8_activations: bool = False) -> QuantizedHeads:
        """`w [G, N, K]` quantized to `method` (INT8/INT4)."""
        return cls(quantize(w.detach(), method, group_size), workspace, int8_activations)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights `[G, N, K]` as the kernels compute with them."""
        return dequantize(self.stack).to(dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.stack.method}, activations={'int8' if self.int8_activations else 'fp32'}, "
                f"group_size={self.stack.group_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x.reshape(-1, self.heads, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def on_rows(self, tokens: int) -> bool:
        """Whether `tokens` fp32 tokens go through the row-dot kernel (row_weights)."""
        return tokens < self.rows_tokens[torch.float32]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, K] -> [T, G, N] in x's dtype, by the path that wins at T tokens (the crossovers as measured for x's
        dtype: fp32 inputs keep theirs, and on AMX their longer stay on the tiles, whatever matmul_dtype says)."""
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 and bf16_gemm_wins() else torch.float32
        if x.shape[0] < self.rows_tokens[dtype]:
            return self._rows(x)
        return self._amx(x) if x.shape[0] < self.gemm_tokens[dtype] else self._matmul(x, self.matmul_dtype(x))

    def matmul_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What the matmul path dequantizes into and multiplies in: bf16 where oneDNN's bf16 GEMM beats its fp32
        one (target.bf16_gemm_wins) for bf16 inputs, and for fp32 ones where this layer dots int8 activations (its
        row dots quantize x to 8 bits; bf16 rounds x and W by at most 2^-9: a CPU-only prefill's dense layers ran
        4-5x slower in fp32 on a Zen 5, 130 against 400-670 GFLOP/s), else fp32 (the exact choice)."""
        return torch.bfloat16 if (x.dtype == torch.bfloat16 or self._q8) and bf16_gemm_wins() else torch.float32

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """Few tokens: the row-dot kernel on x in fp32 (it pads x to the stored row length itself)."""
        return self._fused(x, lambda xf, w, out: linear_kernels.linear_rows(xf, *self.row_weights,
                                                                     numba.config.NUMBA_NUM_THREADS, out))

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        """More tokens on an AMX CPU: the AMX tiles on x in fp32 (int8-quantized per weight group inside)."""
        return self._fused(x, lambda xf, w, out: amx_kernels.linear_amx(
            xf, w.qweight, w.scales, self._steps, w.group_shift, w.kp, numba.config.NUMBA_NUM_THREADS, out))

    def _fused(self, x: torch.Tensor,
               kernel: Callable[[np.ndarray, QuantizedWeight, np.ndarray], None]) -> torch.Tensor:
        """x [T, G, K] -> [T, G, N] by one of the numba kernels reading the stored bytes, in fp32."""
        self.workspace.scratch()  # first call on a thread: sets its numba thread count (see _Scratch)
        out = torch.empty(x.shape[0], self.heads, self.out_features)
        kernel((x if x.dtype == torch.float32 else x.float()).contiguous().numpy(), self.stack, out.numpy())
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _matmul(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """More tokens: dequantize tile by tile (whole matrices where they fit, else rows of one) into `dtype`
        and let torch multiply."""
        w, scratch = self.stack, self.workspace.scratch()
        heads, n, k = self.heads, self.out_features, self.in_features
        xt = x.to(dtype).transpose(0, 1)  # [G, T, K]
        out = torch.empty(heads, x.shape[0], n, dtype=dtype)
        per_tile = max(1, min(heads, TILE_WEIGHTS // (n * k)))  # whole matrices per tile
        tile_rows = n if per_tile > 1 else max(1, min(n, TILE_WEIGHTS // k))
        tile = scratch.tensor("tile", per_tile * tile_rows * k, dtype)
        rows = scratch.array("rows", (numba.config.NUMBA_NUM_THREADS, 2, w.kp), np.float32)
        for g in range(0, heads, per_tile):
            hg = slice(g, min(heads, g + per_tile))
            for lo in range(0, n, tile_rows):
                hi = min(n, lo + tile_rows)
                gemm.stored_matmul(xt[hg], w.qweight[hg, lo:hi], w.scales[hg, lo:hi], w.group_shift, w.kp, k, rows,
                                   tile, out[hg, :, lo:hi])
        out = out.transpose(0, 1)
        return out if dtype == x.dtype else out.to(x.dtype)


class QuantizedLinear(QuantizedHeads):
    """`nn.Linear` with its weight in a QuantizedWeight `[N, K]` (held as `stack`, a stack of one); `output_op` (if any) is applied to the output, as the replaced layer did after its matmul (the
    tensor-parallel lm_head's all-gather)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, workspace: DenseWorkspace | None = None,
                 output_op: Callable[[torch.Tensor], torch.Tensor] | None = None, int8_activations: bool = False):
        if weight.qweight.ndim != 2:
            raise ValueError(f"QuantizedLinear takes one [N, K] matrix, got shape {weight.shape}")
        super().__init__(dataclasses.replace(weight, qweight=weight.qweight[None], scales=weight.scales[None]),
                         workspace, int8_activations)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.output_op = output_op

    @classmethod
    def from_linear(cls, layer: nn.Linear, method: str, group_size: int | None, workspace: DenseWorkspace | None = None,
                    int8_activations: bool = False) -> QuantizedLinear:
        """`layer`'s weight quantized to `method` (INT8/INT4); its bias, memory-plan component tag and
        `output_op` carry over."""
        out = cls(quantize(layer.weight.detach(), method, group_size),
                  None if layer.bias is None else layer.bias.detach(), workspace, getattr(layer, "output_op", None),
                  int8_activations)
        component = getattr(layer, "plan_component", None)
        if component is not None:  # a tagged Linear (lm_head) keeps its component; others inherit the parent's
            out.plan_component = component
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[N, K]` as the kernels compute with it."""
        return super().dequantized(dtype)[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.stack.method}, "
                f"activations={'int8' if self.int8_activations else 'fp32'}, "
                f"group_size={self.stack.group_size}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x.reshape(-1, 1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y.add_(self.bias)
        return y if self.output_op is None else self.output_op(y)


def swiglu_weights(gate_up: nn.Module, down: nn.Module, tokens: int) -> tuple[RowWeights, RowWeights] | None:
    """The stored matrices device_blocks.swiglu_rows takes for a SwiGLU MLP whose gate_up stacks gate's rows over
    up's, where both run `tokens` fp32 tokens on their row path (quantized, no bias or output op); else None (also
    under KTLITE_FORCE_TORCH_KERNELS)."""
    both = linear_row_weights(gate_up, tokens), linear_row_weights(down, tokens)
    return None if None in both else both


def linear_row_weights(layer: nn.Module, tokens: int) -> RowWeights | None:
    """The stored matrix a compiled caller runs `tokens` fp32 tokens of `layer` through (project_rows' w), where it
    is a QuantizedLinear without bias or output op on its row path at that count; else None (also under
    KTLITE_FORCE_TORCH_KERNELS)."""
    if (forced_torch() or not isinstance(layer, QuantizedLinear) or layer.bias is not None
            or layer.output_op is not None or not layer.on_rows(tokens)):
        return None
    return layer.row_weights


def norm_linear_block(norm: np.ndarray, eps: float, linear: RowWeights) -> Callable:
    """The final norm and lm_head of a compiled decode step (runtime/compiled_decode.py): (x [T, K], rows) ->
    linear(RMSNorm(x[rows])) [len(rows), N] fp32 (device_blocks.norm_project_rows)."""
    eps = np.float32(eps)
    threads = numba.config.NUMBA_NUM_THREADS

    def run(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return device_blocks.norm_project_rows(x, rows, norm, eps, linear, threads)
    return run


def swiglu_residual_block(norm: np.ndarray, eps: float, gate_up: RowWeights, down: RowWeights) -> Callable:
    """A dense layer's MLP block as a compiled decode step's block (runtime/compiled_decode.py): x -> x +
    down(SiLU(gate) * up) of RMSNorm(x) (device_blocks.swiglu_residual); norm, eps: the layer's post-attention norm."""
    eps = np.float32(eps)
    threads = numba.config.NUMBA_NUM_THREADS

    def run(x: np.ndarray, step: tuple) -> np.ndarray:
        return device_blocks.swiglu_residual(x, norm, eps, gate_up, down, threads)
    return run


def swiglu_rows(x: torch.Tensor, gate_up: nn.Module, down: nn.Module) -> torch.Tensor | None:
    """down(SiLU(gate) * up) for x [T, K] where gate_up stacks gate's rows over up's, as one compiled call: both
    projections on their row path back to back, so the second's worker thread is still awake (a parallel region
    after some Python waits ~20 us for it on a 2-core VM). None where that path does not take x (not few fp32
    tokens on a CPU, swiglu_weights): the caller runs the modules."""
    weights = None
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        weights = swiglu_weights(gate_up, down, x.shape[0])
    if weights is None:
        return None
    return torch.from_numpy(device_blocks.swiglu_rows(x.contiguous().numpy(), *weights, numba.config.NUMBA_NUM_THREADS))
