"""Routed experts for many tokens: dequantize each expert to bf16 (or fp32) and use torch.matmul.

oneDNN's bf16 GEMM runs at several hundred GFLOP/s on 2 Zen cores against ~50 GFLOP/s for the
fused numba kernel's fp32 FMAs (bench/history/), so once an expert has enough tokens it pays to
expand it once and let oneDNN do the math. Dequantization is a parallel numba kernel (linear_kernels.py, vector
intrinsics) that writes bf16 bits, rounded to nearest even, into a buffer the caller reuses across experts.
(Expanding in cache-sized row tiles instead was measured: the smaller GEMMs lost more than the cache
hits saved, 5 % on V3 experts.)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ktlite.kernels.cpu.linear_kernels import dequant_rows_bf16, dequant_rows_f32


def dequant_matrix(q: np.ndarray, s: np.ndarray, group_shift: int, kp: int, k: int, dtype: torch.dtype,
                   scratch: np.ndarray, out: np.ndarray | None = None) -> torch.Tensor:
    """One stored matrix -> torch [N, K] in `dtype` (bf16 or fp32); scratch [threads, 2, >= kp] fp32.
    `out` (uint16 for bf16, fp32 for fp32, [N, K], C-contiguous) is reused if given: a fresh 10-60 MB
    array per expert page-faults on first touch, which cost as much as the decoding itself."""
    if q.dtype == np.uint16:  # BF16 storage: already the values
        w = torch.from_numpy(q[:, :k]).view(torch.bfloat16)
        return w if dtype == torch.bfloat16 else w.to(dtype)
    if dtype == torch.bfloat16:
        out = np.empty((q.shape[0], k), np.uint16) if out is None else out
        dequant_rows_bf16(q, s, group_shift, kp, scratch, out)
        return torch.from_numpy(out).view(torch.bfloat16)
    out = np.empty((q.shape[0], k), np.float32) if out is None else out
    dequant_rows_f32(q, s, group_shift, kp, scratch, out)
    return torch.from_numpy(out)


def numpy_bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor; bf16 (which numpy lacks) as its uint16 bit patterns, as the kernels take it."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def stored_matmul(x: torch.Tensor, q: np.ndarray, s: np.ndarray, group_shift: int, kp: int, k: int,
                  scratch: np.ndarray, buf: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [..., m, N] = x [..., m, K] @ W.T for one stored matrix W (q/s [N, ...]), or for a stack of them
    (q/s [G, N, ...], x and out [G, m, ...]: matrix g for x[g]), in x's dtype, W dequantized into `buf` (flat,
    x's dtype, >= G * N * K elements; None for BF16 storage, whose rows are used in place)."""
    lead = q.shape[:-1]  # ([G,] N)
    rows = math.prod(lead)
    dst = None if buf is None else numpy_bits(buf)[:rows * k].reshape(rows, k)
    w = dequant_matrix(q.reshape(rows, q.shape[-1]), s.reshape(rows, s.shape[-1]), group_shift, kp, k, x.dtype,
                       scratch, dst).view(*lead, k)
    if x.dim() == 3 and x.shape[0] == 1:  # a stack of one as a 2-D GEMM: torch's bf16 bmm of one took 3.7x its time
        x, w, out = x[0], w[0], out[0]
    torch.matmul(x, w.transpose(-1, -2), out=out)


def expert_mlp_matmul(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [m, H] -> down(SiLU(gate x) * up x) [m, H], in w's dtype (gate rows then up rows)."""
    gu = x @ w_gate_up.T
    inter = w_gate_up.shape[0] // 2
    return (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w_down.T
