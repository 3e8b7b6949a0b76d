"""`linear_rows` is the experts' GEMV (moe_kernels.moe_rows) for a stack of plain matrices, each with its own inputs:
the device-side Linear layers (one matrix) and per-head matrices (MLA's W_UK / W_UV) of a CPU-only run
(dense_linear.py); `project_rows` allocates its output. `dequant_rows_f32` / `dequant_rows_bf16` expand stored rows
for gemm.py's dequantize + oneDNN path.
"""

from __future__ import annotations

import numpy as np
from numba import get_thread_id, njit, prange

from ktlite.kernels.cpu.activations import activation_views
from ktlite.kernels.cpu.int8_dots import TILE_ROWS, TILE_TOKENS, row_dot_q8, runs_as_tiles, tile_dot_q8
from ktlite.kernels.cpu.rowdots import DECODE_ONCE_TOKENS, decode_row, f32_dot, row_dot
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process

ROWS_PER_CHUNK = 16  # rows per parallel task of linear_rows


@njit(nogil=True, cache=True)
def stacked_inputs(x, kp):
    """x [T, G, K] -> [T * G, kp] fp32, row t * G + g token t's input to matrix g, zeros past K."""
    tokens, groups = x.shape[0], x.shape[1]
    xp = np.zeros((tokens * groups, kp), np.float32)
    for t in range(tokens):
        for g in range(groups):
            xp[t * groups + g, :x.shape[2]] = x[t, g]
    return xp


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def linear_rows(x, q, s, group_shift, kp, q8, threads, out):
    """out [T, G, N] fp32: out[t, g] = W_g @ x[t, g] for G stacked matrices W_g (q/s [G, N, ...], any storage
    format, rows of kp weights): the device-side Linear layers (G = 1) and per-head matrices (MLA's W_UK /
    W_UV, G = heads) of a CPU-only run (dense_linear.py). x [T, G, K] fp32 (K <= kp; padded with zeros here,
    where it costs no Python); q8 as in moe_rows; threads: numba's thread count (the per-thread row buffers).
    As moe_rows for one expert: parallel over chunks of output rows of every matrix, each row dotted from its
    stored bytes with every token, or (fp32 activations) from DECODE_ONCE_TOKENS tokens on, decoded once into
    fp32 and dotted from there."""
    tokens, groups = x.shape[0], x.shape[1]
    rows = q.shape[1]
    xp = stacked_inputs(x, kp)
    xs, xq, xd, xo = activation_views(xp, q8)
    once = not q8 and tokens >= DECODE_ONCE_TOKENS
    tiled = runs_as_tiles(q8, q, tokens)
    # row buffers allocated before the parallel region (inside it they page-faulted: see moe_rows)
    scratch = np.empty((threads if once else 0, kp), np.float32)
    tiles = np.empty((threads if tiled else 0, TILE_ROWS, TILE_TOKENS), np.float32)
    xrow = np.empty((groups, tokens), np.int64)  # xrow[g, t]: the row of xp (xq, xd) with token t's input to W_g
    for g in range(groups):
        xrow[g] = np.arange(tokens) * groups + g
    chunks = (rows + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    for task in prange(groups * chunks):
        g = task // chunks
        c = task - g * chunks
        n_hi = min(rows, (c + 1) * ROWS_PER_CHUNK)
        if tiled:
            tile = tiles[get_thread_id()]
            for n0 in range(c * ROWS_PER_CHUNK, n_hi, TILE_ROWS):
                for t0 in range(0, tokens, TILE_TOKENS):
                    tix = xrow[g, t0:min(tokens, t0 + TILE_TOKENS)]
                    tile_dot_q8(q[g], s[g], n0, xq, xd, tix, group_shift, tile)
                    for i in range(min(TILE_ROWS, n_hi - n0)):
                        for j in range(tix.shape[0]):
                            out[t0 + j, g, n0 + i] = tile[i, j]
            continue
        for n in range(c * ROWS_PER_CHUNK, n_hi):
            qr, sr = q[g, n], s[g, n]
            if once:
                buf = scratch[get_thread_id()]
                decode_row(qr, sr, buf, group_shift)
                for t in range(tokens):
                    out[t, g, n] = f32_dot(buf, xp[t * groups + g])
            elif q8:
                for t in range(tokens):
                    r = t * groups + g
                    out[t, g, n] = row_dot_q8(qr, sr, xp[r], xs[r], xq[r], xd[r], xo[r], group_shift)
            else:
                for t in range(tokens):
                    r = t * groups + g
                    out[t, g, n] = row_dot(qr, sr, xp[r], xs[r], group_shift)


@njit(nogil=True, cache=True)
def project_rows(x, w, threads):
    """linear_rows for a compiled caller: x [T, G, K] (C-contiguous) through stored matrices w = (qweight, scales,
    group_shift, kp, q8) -> a fresh [T, G, N] fp32 array."""
    q, s, group_shift, kp, q8 = w
    out = np.empty((x.shape[0], q.shape[0], q.shape[1]), np.float32)
    linear_rows(x, q, s, group_shift, kp, q8, threads, out)
    return out


@njit(parallel=True, nogil=True, cache=True)
def dequant_rows_f32(q, s, group_shift, kp, scratch, out):
    """q/s [N, ...] one stored INT8/INT4 matrix -> out fp32 [N, K] (K <= kp); scratch [threads, 2,
    >= kp] fp32 row buffers, used when K < kp (one per thread: allocating inside prange page-faults)."""
    k = out.shape[1]
    for n in prange(q.shape[0]):
        if k == kp:
            decode_row(q[n], s[n], out[n], group_shift)
        else:
            buf = scratch[get_thread_id(), 0, :kp]
            decode_row(q[n], s[n], buf, group_shift)
            out[n, :] = buf[:k]


@njit(parallel=True, nogil=True, cache=True)
def dequant_rows_bf16(q, s, group_shift, kp, scratch, out):
    """q/s [N, ...] one stored INT8/INT4 matrix -> out uint16 bf16 bits [N, K] (K <= kp), round to
    nearest even; scratch as in dequant_rows_f32."""
    k = out.shape[1]
    for n in prange(q.shape[0]):
        if k == kp:
            decode_row(q[n], s[n], out[n], group_shift)
        else:
            buf = scratch[get_thread_id(), 0].view(np.uint16)[:kp]
            decode_row(q[n], s[n], buf, group_shift)
            out[n, :] = buf[:k]
