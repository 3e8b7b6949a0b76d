"""FP8 (float8_e4m3fn) expert weights as checkpoints ship them, kept FP8 in CPU RAM.

Storage (a QuantizedWeight with method "FP8"): `qweight` [..., N, Kp] of the record dtype E4M3 (one
byte, the e4m3 bit pattern; a record so numba dispatches on it like any other format), `scales` fp32
[..., N, Kp / G]: w[n, k] = e4m3(q[n, k]) * scales[n, k // G]. Kp is K rounded up to a multiple of
max(G, 64) (the kernels read whole 64-byte chunks), padded with 0x00 (+0.0).

Checkpoints hold either one `weight_scale_inv` per 128 x 128 block ([ceil(N/128), ceil(K/128)], the
common block-FP8 layout) or one scale per output channel ([N] or [N, 1], "per-channel").
Both are stored per row and per G = the block's K width (128 for per-channel): block scales repeat
down their 128 rows and a channel's scale across its row, so every format keeps one kernel layout at
4 bytes per G weights (3 % of the FP8 bytes) instead of a second index scheme in every kernel.
Dequantized values are e4m3 * scale in fp32, the same single rounding as the GPU path's
`fp8_dequantize`.
"""

from __future__ import annotations

import numpy as np

from ktlite.errors import CheckpointError

E4M3 = np.dtype([("e4m3", np.uint8)])
CHANNEL_GROUP = 128  # G for per-channel scales (any multiple of 64 would do; 128 matches block FP8)


def fp8_group_size(block: tuple[int, int] | None) -> int:
    """G of the stored scales for a checkpoint's weight_block_size (None: per-channel)."""
    return CHANNEL_GROUP if block is None else block[1]


def fp8_group(scale_shape: tuple[int, ...], n: int, k: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """(rows per scale, K per scale) of a checkpoint's FP8 scale tensor for a weight [n, k]; `block` is
    the checkpoint's weight_block_size, None for per-channel scales."""
    if block is None:
        if tuple(scale_shape) not in ((n,), (n, 1)):
            raise CheckpointError(f"per-channel FP8 scale of shape {tuple(scale_shape)} does not match weight [{n}, {k}]")
        return 1, CHANNEL_GROUP
    bn, bk = block
    if tuple(scale_shape) != (-(-n // bn), -(-k // bk)):
        raise CheckpointError(f"FP8 scale of shape {tuple(scale_shape)} does not tile weight [{n}, {k}] in "
                              f"{bn}x{bk} blocks")
    if bk & (bk - 1) or bk < 32:
        raise CheckpointError(f"FP8 blocks {bn}x{bk}: ktlite's kernels need a power-of-two block width >= 32")
    return bn, bk


def fill_fp8_rows(q: np.ndarray, s: np.ndarray, weight: np.ndarray, scale: np.ndarray,
                  block: tuple[int, int] | None) -> None:
    """Store one checkpoint matrix: `weight` [N, K] (the e4m3 bytes as uint8) with its fp32 scale (block
    [N/bn, K/bk], or per-channel [N] / [N, 1] when `block` is None) into q [N, Kp] (E4M3), s [N, Kp / G]."""
    n, k = weight.shape
    rows, g = fp8_group(tuple(scale.shape), n, k, block)
    if q.shape[0] != n or s.shape[-1] * g != q.shape[-1]:
        raise CheckpointError(f"FP8 weight [{n}, {k}] with {g}-column scales does not fit storage {q.shape}")
    q.view(np.uint8)[:, :k] = weight
    per_row = scale.astype(np.float32, copy=False).reshape(scale.shape[0], -1)  # [N / rows, groups] or [N, 1]
    if rows > 1:
        per_row = np.repeat(per_row, rows, axis=0)[:n]
    if block is None:  # per-channel: the row's scale in every group
        s[:] = per_row
    else:
        s[:, :per_row.shape[1]] = per_row
        s[:, per_row.shape[1]:] = 0.0  # groups of the zero padding
