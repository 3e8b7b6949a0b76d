"""Microscaling (OCP MX) expert weights as checkpoints ship them, kept in their own precision in CPU RAM.

Two storage formats of a QuantizedWeight, one e8m0 scale byte per 32 consecutive weights of a row
(w = value(code) * 2^(scale - 127)):

- "MXFP4": e2m1 codes, two a byte, the low nibble the even k (gpt-oss's `*_blocks` [E, out, in/32, 16]
  and DeepSeek-V4's FP4 experts [out, in/2] are these same bytes): `qweight` [..., N, Kp / 2] of the record
  dtype E2M1X2 (one byte; a record so numba dispatches on it apart from INT4's plain uint8),
  `scales` uint8 [..., N, Kp / 32]. 4.25 bits a weight.
- "MXFP8": e4m3 codes (fp8.E4M3 records) [..., N, Kp], `scales` uint8 [..., N, Kp / 32]. 8.25 bits a weight.
  The scale dtype (uint8, not FP8's fp32) is what the kernels dispatch the two e4m3 formats on.

Kp is K rounded up to a multiple of 64 (the kernels read 64 weights a step); the padding holds code 0 (+0)
with scale byte 127 (1.0). Values: e2m1 {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives (OCP MX v1.0,
table of FP4 E2M1, the table transformers' mxfp4 integration uses); e8m0 byte s is 2^(s - 127) in fp32,
0 being the subnormal 2^-127. The product of a code and its scale is one fp32 rounding (exact unless it
overflows), bit for bit transformers' for s = 0..254 (MXFP8: 0..246, MXFP8_MAX_SCALE_BYTE); 255 (the spec's NaN,
which no quantizer writes) is not decoded as NaN.
"""

from __future__ import annotations

import numpy as np

from ktlite.errors import CheckpointError
from ktlite.kernels.cpu.fp8 import E4M3

E2M1X2 = np.dtype([("e2m1x2", np.uint8)])
MX_GROUP = 32  # weights per e8m0 scale
MX_METHODS = ("MXFP4", "MXFP8")  # storage formats of this module
SCALE_ONE = 127  # e8m0 byte of 1.0: the padding groups' scale
# The row kernels decode e4m3 as value * 2^-8 (an fp16) and fold the 2^8 into the group's scale, which must stay an
# fp32: 2^(s - 127 + 8) <= 2^127. Larger MXFP8 scales (2^120 and up: weights no bf16 model has) are refused at load.
MXFP8_MAX_SCALE_BYTE = 246
# e2m1 code -> value (OCP MX v1.0's FP4 E2M1 table; the kernels decode it by integer ops)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def code_dtype(method: str) -> np.dtype:
    """The record dtype of a format's stored codes."""
    return E2M1X2 if method == "MXFP4" else E4M3


def codes_per_byte(method: str) -> int:
    return 2 if method == "MXFP4" else 1


def fill_mx_rows(q: np.ndarray, s: np.ndarray, codes: np.ndarray, scales: np.ndarray, method: str) -> None:
    """Store one checkpoint matrix [N, K] as it is: `codes` [N, K / codes_per_byte] bytes (any 1-byte dtype),
    `scales` [N, K / 32] e8m0 bytes, into q [N, Kp / codes_per_byte] (the format's records) and s [N, Kp / 32]."""
    codes = np.asarray(codes).view(np.uint8)
    scales = np.asarray(scales).view(np.uint8)
    n, nbytes = codes.shape
    k = nbytes * codes_per_byte(method)
    if scales.shape != (n, -(-k // MX_GROUP)) or k % MX_GROUP:
        raise CheckpointError(f"{method} codes [{n}, {nbytes}] bytes need e8m0 scales [{n}, {k // MX_GROUP}] "
                              f"(one per {MX_GROUP} weights); found {tuple(scales.shape)}")
    if method == "MXFP8" and scales.size and int(scales.max()) > MXFP8_MAX_SCALE_BYTE:
        raise CheckpointError(f"MXFP8 e8m0 scale byte {int(scales.max())} (2^{int(scales.max()) - 127}) is above "
                              f"{MXFP8_MAX_SCALE_BYTE} (2^{MXFP8_MAX_SCALE_BYTE - 127}): no bf16 model's weights need "
                              "it; the file is not an MXFP8 checkpoint ktlite can keep as stored")
    if q.shape[0] != n or q.shape[-1] < nbytes or s.shape[-1] * MX_GROUP != q.shape[-1] * codes_per_byte(method):
        raise CheckpointError(f"{method} matrix [{n}, {k}] does not fit storage {q.shape}")
    raw = q.view(np.uint8)
    raw[:, :nbytes] = codes
    raw[:, nbytes:] = 0
    s[:, :scales.shape[1]] = scales
    s[:, scales.shape[1]:] = SCALE_ONE
