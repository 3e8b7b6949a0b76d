"""compressed-tensors `pack-quantized` INT4 (routed experts shipped as INT4) into ktlite's INT4.

The checkpoint stores, per expert matrix [N, K] (symmetric, one scale per group of 32 along K):
`weight_packed` int32 [N, K / 8] with weight k of a row in bits 4 (k % 8) of word k // 8 (so byte j
of the row holds k = 2j in its low nibble and k = 2j + 1 in its high nibble), each nibble the code
q + 8 for q in [-8, 7]; `weight_scale` [N, K / 32] (bf16); `weight_shape` [2] = (N, K). The weight
is q * scale, which is exactly what ktlite's INT4 format with G = 32 computes ((nibble - 8) * s with
fp32 scales; bf16 -> fp32 is exact), so loading is a permutation of nibbles and a widening of the
scales: no value changes. The GPU INT4 format (kernels/triton/quant.py) takes the same codes in its
own nibble order.
"""

from __future__ import annotations

import numpy as np
import torch

from ktlite.errors import CheckpointError
from ktlite.kernels.cpu.quant import INT4_CHUNK
from ktlite.kernels.triton.quant import QuantizedWeight as GPUQuantizedWeight

GROUP = 32


def unpack_codes(packed: np.ndarray, k: int) -> np.ndarray:
    """weight_packed int32 [N, ceil(K / 8)] -> nibbles uint8 [N, K] (code + 8, as stored)."""
    if packed.dtype != np.int32 or packed.ndim != 2 or packed.shape[1] * 8 < k:
        raise CheckpointError(f"weight_packed of dtype {packed.dtype} and shape {packed.shape} does not hold K = {k} "
                              "4-bit codes as int32")
    b = np.ascontiguousarray(packed).view("<u1").reshape(packed.shape[0], -1)  # little-endian bytes
    out = np.empty((b.shape[0], 2 * b.shape[1]), np.uint8)
    out[:, 0::2] = b & 15
    out[:, 1::2] = b >> 4
    return out[:, :k]


def fill_int4_rows(q: np.ndarray, s: np.ndarray, nibbles: np.ndarray, scale: np.ndarray) -> None:
    """Store nibbles [N, K] and fp32 scales [N, K / 32] into ktlite INT4 rows q [N, Kp / 2], s [N, Kp / 32]."""
    n, k = nibbles.shape
    kp = q.shape[1] * 2
    if scale.shape != (n, -(-k // GROUP)) or s.shape != (n, kp // GROUP):
        raise CheckpointError(f"weight_scale of shape {scale.shape} does not match a [{n}, {k}] weight in groups of {GROUP}")
    padded = np.full((n, kp), 8, np.uint8)  # code 8 is the value 0
    padded[:, :k] = nibbles
    chunks = padded.reshape(n, kp // INT4_CHUNK, 2, INT4_CHUNK // 2)  # byte j: k = j (low), k = j + 64 (high)
    q[:] = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, kp // 2)
    s[:, :scale.shape[1]] = scale
    s[:, scale.shape[1]:] = 0.0


def gpu_int4(nibbles: list[np.ndarray], scales: list[np.ndarray]) -> GPUQuantizedWeight:
    """Stacked experts' nibbles [N, K] and fp32 scales [N, K / 32] -> the GPU INT4 format (group 32): in
    each group, byte j holds k = j (low nibble) and k = j + 16 (high nibble)."""
    nib = np.stack(nibbles)
    e, n, k = nib.shape
    if k % GROUP:
        raise CheckpointError(f"the GPU INT4 format needs K = {k} to be a multiple of {GROUP}")
    groups = nib.reshape(e, n, k // GROUP, 2, GROUP // 2)
    packed = (groups[..., 0, :] | (groups[..., 1, :] << 4)).reshape(e, n, k // 2)
    return GPUQuantizedWeight(torch.from_numpy(np.ascontiguousarray(packed)),
                              torch.from_numpy(np.stack(scales).astype(np.float32)), 4, GROUP)
