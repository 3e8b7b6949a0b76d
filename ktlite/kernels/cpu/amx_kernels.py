"""`moe_amx` is moe_kernels.moe_rows on AMX-INT8 tiles (CPUs with AMX, INT4/INT8 experts with groups of >= 64): per
expert, blocks of 32 weight rows times pairs of tiles of 16 tokens' int8 activations quantized per weight group,
each group's int32 sums rescaled (amx_tiles.amx_block_dot, see AMX_ROWS there); INT4 rows whose group scales are
whole multiples of one step per row (fold_steps; ktlite's quantizer makes them so) unpack as code x multiple
instead and sum whole rows against activations quantized per token, a 16-row weight tile times up to four token
tiles (amx_tiles.amx_folded_block_dot). `linear_amx` is the same for the device-side Linear layers
(dense_linear.py).
"""

from __future__ import annotations

import numpy as np
from numba import get_thread_id, njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu.activations import pack_amx_tile, pair_rows, quantize_groups
from ktlite.kernels.cpu.amx_tiles import (
    AMX_BLOCK_ROWS, AMX_ROWS, AMX_TILE_BYTES, AMX_TOKEN_TILES, FOLDED_TOKEN_TILES, INT8_TOKEN_TILES, SUMS_TILES,
    amx_block_dot, amx_folded_block_dot, tile_into_rows, transpose_sums,
)
from ktlite.kernels.cpu.linear_kernels import stacked_inputs
from ktlite.kernels.cpu.quantizer import INT4_MULTIPLES
from ktlite.kernels.cpu.simd import silu_mul
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process


@njit(nogil=True, cache=True)
def _token_tiles(tok_ptr):
    """Expert m's pairs tok_ptr[m]:tok_ptr[m + 1] in tiles of AMX_ROWS: (tile_ptr [M + 1]: expert m's tiles are
    tile_ptr[m]:tile_ptr[m + 1]; first, end: the pairs first[t]:end[t] of tile t)."""
    n_experts = tok_ptr.shape[0] - 1
    tile_ptr = np.zeros(n_experts + 1, np.int64)
    for m in range(n_experts):
        tile_ptr[m + 1] = tile_ptr[m] + (tok_ptr[m + 1] - tok_ptr[m] + AMX_ROWS - 1) // AMX_ROWS
    first = np.empty(tile_ptr[n_experts], np.int64)
    end = np.empty(tile_ptr[n_experts], np.int64)
    for m in range(n_experts):
        for t in range(tile_ptr[m], tile_ptr[m + 1]):
            first[t] = tok_ptr[m] + (t - tile_ptr[m]) * AMX_ROWS
            end[t] = min(first[t] + AMX_ROWS, tok_ptr[m + 1])
    return tile_ptr, first, end


@njit(nogil=True, cache=True)
def cache_line_bytes(n):
    """np.empty(n, uint8) starting on a 64-byte cache line (numpy's own start 16 bytes into one): the arrays AMX
    tiles load from, whose tile rows must not straddle two lines (tile loads 6x slower)."""
    buf = np.empty(n + 64, np.uint8)
    start = -buf.ctypes.data & 63
    return buf[start:start + n]


@njit(nogil=True, cache=True)
def _on_cache_lines(n):
    """np.empty(n, float32) starting on a cache line: numba's np.empty starts 32 bytes into one, so every 16-float row
    of the block dots' out split across two lines, for each load and store of the rescale after each group."""
    return cache_line_bytes(4 * n).view(np.float32)


@njit(nogil=True, cache=True)
def _block_sums(threads):
    """The block dots' out for each thread and half (gate / up): [threads, 2, SUMS_TILES, 32, 16] fp32."""
    return _on_cache_lines(threads * 2 * SUMS_TILES * AMX_BLOCK_ROWS * AMX_ROWS).reshape(
        (threads, 2, SUMS_TILES, AMX_BLOCK_ROWS, AMX_ROWS))


@njit(parallel=True, nogil=True, cache=True)
def _pack_tiles(x, rows, first, end, gsize):
    """The activation tiles (pack_amx_tile) of every expert: tile t holds x[rows[p]] for its pairs first[t]:end[t],
    quantized per gsize values. Each row of x is quantized once, however many experts it goes to (V3: 8)."""
    xq, xd = quantize_groups(x, gsize)
    xb = cache_line_bytes(first.shape[0] * x.shape[1] * 16).view(np.int8).reshape((first.shape[0], x.shape[1] // 4, 64))
    xdb = np.empty((first.shape[0], x.shape[1] // gsize, AMX_ROWS), np.float32)
    for t in prange(first.shape[0]):
        pack_amx_tile(xq, xd, rows[first[t]:end[t]], xb[t], xdb[t])
    return xb, xdb


NO_STEPS = np.empty((0, 0, 1), np.float32)  # fold_steps' answer where the scales do not fold


@njit(parallel=True, nogil=True, cache=True)
def fold_steps(s):
    """The step of each row of INT4 group scales s [S, N, G] ([S, N, 1] fp32) if every scale is a whole multiple m of
    its row's step (1 <= |m| <= INT4_MULTIPLES, or a zero scale; quantizer._row_multiples makes them so), else
    NO_STEPS: the AMX tiles then unpack code x m and sum whole rows (_amx_matrices). INT4 weights made otherwise (a
    conversion from before the multiples) keep the per-group path. Once per stored matrix (moe.ExpertLayer,
    dense_linear)."""
    n_rows, n_groups = s.shape[1], s.shape[2]
    steps = np.empty((s.shape[0], n_rows, 1), np.float32)
    misses = np.zeros(s.shape[0] * n_rows, np.int64)
    limit = np.float32(INT4_MULTIPLES)
    for sr in prange(s.shape[0] * n_rows):
        row = s[sr // n_rows, sr % n_rows]
        top = np.float32(0.0)
        for g in range(n_groups):
            top = max(top, abs(row[g]))
        step = top / limit
        steps[sr // n_rows, sr % n_rows, 0] = step
        inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
        for g in range(n_groups):
            m = np.rint(row[g] * inv)
            misses[sr] += (abs(m) > limit) | (m * step != row[g])
    return steps if misses.sum() == 0 else steps[:0]


@njit(nogil=True, cache=True, fastmath=True)
def _block_multiples(s, steps, r0, m):
    """m [32, G] int8 = s[r0 + i] / steps[r0 + i] for the 32 rows of a block (fold_steps: whole numbers)."""
    for i in range(AMX_BLOCK_ROWS):
        inv = np.float32(1.0) / steps[r0 + i, 0] if steps[r0 + i, 0] > 0 else np.float32(0.0)
        row, mi = s[r0 + i], m[i]
        for g in range(row.shape[0]):
            mi[g] = np.int8(np.rint(row[g] * inv))


def _int4_rows(q):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_int4_rows, inline="always")
def _int4_rows_impl(q):
    """Whether stored matrices q hold INT4 rows (a constant of q's type)."""
    answer = q.dtype == types.uint8
    return lambda q: answer


def _folded_block_dot(q, s, r0, xb, xdb, t0, nt, gs, out, m):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_folded_block_dot, inline="always")
def _folded_block_dot_impl(q, s, r0, xb, xdb, t0, nt, gs, out, m):
    """amx_folded_block_dot for INT4 rows; nothing for INT8 rows, whose steps _amx_project empties."""
    if q.dtype == types.uint8:
        return lambda q, s, r0, xb, xdb, t0, nt, gs, out, m: amx_folded_block_dot(q, s, r0, xb, xdb, t0, nt, gs, out, m)
    return lambda q, s, r0, xb, xdb, t0, nt, gs, out, m: None


@njit(nogil=True, cache=True)
def _weight_passes(tile_ptr, per_pass):
    """The passes over the experts' weights, per_pass of an expert's activation tiles each: (expert, first tile)."""
    n = 0
    for e in range(tile_ptr.shape[0] - 1):
        n += (tile_ptr[e + 1] - tile_ptr[e] + per_pass - 1) // per_pass
    passes = np.empty((n, 2), np.int64)
    n = 0
    for e in range(tile_ptr.shape[0] - 1):
        for p0 in range(tile_ptr[e], tile_ptr[e + 1], per_pass):
            passes[n, 0], passes[n, 1] = e, p0
            n += 1
    return passes


@njit(nogil=True, cache=True)
def _amx_project(q, s, steps, group_shift, x, rows, slots, tile_ptr, first, end, threads, sums, act, tok_idx, tok_w,
                 out):
    """x[rows[p]] of pairs p (tiles as _token_tiles gives them) through the matrices q[slots] on AMX tiles
    (_amx_matrices): with one activation scale per token where the scales fold (steps: fold_steps), else with the
    activations quantized per weight group."""
    if not _int4_rows(q):
        steps = steps[:0]  # INT8 rows never fold: their codes fill the byte
    gsize = x.shape[1] if steps.shape[0] > 0 else 1 << group_shift
    xb, xdb = _pack_tiles(x, rows, first, end, gsize)
    _amx_matrices(q, s, steps, group_shift, xb, xdb, slots, tile_ptr, first, end, threads, sums, act, tok_idx, tok_w,
                  out)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _amx_matrices(q, s, steps, group_shift, xb, xdb, slots, tile_ptr, first, end, threads, sums, act, tok_idx, tok_w,
                  out):
    """One matrix per expert on AMX tiles, pairs' activations in tiles (xb, xdb; tile_ptr, first, end as
    _token_tiles gives them). Where steps is not NO_STEPS (fold_steps; xdb then has one scale per token) each block's
    multiples are taken from the scales and the sums run whole rows (amx_folded_block_dot). With act
    (gate_up: q [E, 2I, ...], gate rows then up rows) act[p, i] = SiLU(gate_i . x_p) * (up_i . x_p); without (act
    empty; down: q [E, H, ...]) out[tok_idx[p], h] += tok_w[p] * (row_h . x_p).
    Each of `threads` tasks owns a contiguous share of the blocks of AMX_BLOCK_ROWS rows (whole columns of act /
    out) and runs every expert over it, so an expert's activation tiles stay in cache across the share. The last
    block starts at N - 32 and writes only the rows no other block wrote. sums [threads, 2, SUMS_TILES, 32, 16]."""
    gated = act.shape[0] > 0
    rows = q.shape[1] // 2 if gated else q.shape[1]
    blocks = (rows + AMX_BLOCK_ROWS - 1) // AMX_BLOCK_ROWS
    share = (blocks + threads - 1) // threads
    # per thread: one tile's sums, transposed
    by_token = _on_cache_lines(threads * AMX_ROWS * AMX_BLOCK_ROWS).reshape((threads, AMX_ROWS, AMX_BLOCK_ROWS))
    folded = steps.shape[0] > 0
    per_call = FOLDED_TOKEN_TILES if folded else AMX_TOKEN_TILES if _int4_rows(q) else INT8_TOKEN_TILES  # per dot
    per_pass = max(1, AMX_TILE_BYTES // (xb.shape[1] * 64 * per_call)) * per_call  # activation tiles per weight pass
    passes = _weight_passes(tile_ptr, per_pass)
    halves = 2 if gated else 1  # gated: the gate rows, then the up rows
    multiples = np.empty((threads, halves, AMX_BLOCK_ROWS, s.shape[2]), np.int8)
    pair_rows, no_weights = np.arange(act.shape[0]), np.empty(0, np.float32)  # gate_up: act's row p is pair p's
    for task in prange(threads):
        tid = get_thread_id()
        for pn in range(passes.shape[0]):
            e, p0 = passes[pn, 0], passes[pn, 1]
            qe, se = q[slots[e]], s[slots[e]]
            for b in range(task * share, min(blocks, (task + 1) * share)):
                r0 = min(b * AMX_BLOCK_ROWS, rows - AMX_BLOCK_ROWS)
                skip = b * AMX_BLOCK_ROWS - r0  # the rows the block before this (last) one wrote
                if folded:
                    for half in range(halves):
                        _block_multiples(se, steps[slots[e]], half * rows + r0, multiples[tid, half])
                for t0 in range(p0, min(p0 + per_pass, tile_ptr[e + 1]), per_call):
                    nt = min(per_call, tile_ptr[e + 1] - t0)
                    for half in range(halves):
                        r = half * rows + r0
                        if folded:
                            _folded_block_dot(qe, steps[slots[e]], r, xb, xdb, t0, nt, group_shift, sums[tid, half],
                                              multiples[tid, half])
                        else:
                            amx_block_dot(qe, se, r, xb, xdb, t0, nt, group_shift, sums[tid, half])
                    for j in range(nt):
                        if gated:
                            silu_mul(sums[tid, 0, j], sums[tid, 1, j])
                        transpose_sums(sums[tid, 0, j], by_token[tid])
                        if gated:
                            tile_into_rows(by_token[tid], act, pair_rows, first[t0 + j], end[t0 + j] - first[t0 + j],
                                           no_weights, r0, skip)
                        else:
                            tile_into_rows(by_token[tid], out, tok_idx, first[t0 + j], end[t0 + j] - first[t0 + j],
                                           tok_w, r0, skip)


@njit(nogil=True, cache=True)
def moe_amx(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift, threads, act,
            out):
    """moe_rows with int8 activations on AMX tiles (INT4/INT8 rows, groups of >= AMX_MIN_GROUP, I and H >= 32):
    per expert, its pairs' activations in tiles of 16 tokens, 32-row weight blocks times a few of them at once
    (_amx_matrices). gu_steps / d_steps: fold_steps of the matrices (NO_STEPS: per-group path). threads:
    numba's thread count (per-thread sums); the other arguments as moe_rows."""
    tile_ptr, first, end = _token_tiles(tok_ptr)
    sums = _block_sums(threads)
    _amx_project(gu_q, gu_s, gu_steps, gu_shift, x, tok_idx, slots, tile_ptr, first, end, threads, sums, act, tok_idx,
                 tok_w, out)
    _amx_project(d_q, d_s, d_steps, d_shift, act, np.arange(act.shape[0]), slots, tile_ptr, first, end, threads, sums,
                 act[:0], tok_idx, tok_w, out)


@njit(nogil=True, cache=True)
def linear_amx(x, q, s, steps, group_shift, kp, threads, out):
    """linear_rows' job (same arguments, int8 activations) on AMX tiles: INT4/INT8 rows, groups of >= AMX_MIN_GROUP,
    N >= 32; steps: fold_steps(s) (or NO_STEPS). Matrix g's tokens x[:, g] are its "pairs": _amx_matrices as for the
    experts' down projection, each token weighted 1 into out (zeroed here) viewed as [T * G, N]."""
    tokens, groups = x.shape[0], x.shape[1]
    xp = stacked_inputs(x, kp)
    rows = np.empty(tokens * groups, np.int64)  # pair g * tokens + t (matrix g's t-th) reads row t * groups + g
    for t in range(tokens):
        for g in range(groups):
            rows[g * tokens + t] = t * groups + g
    tile_ptr, first, end = _token_tiles(np.arange(groups + 1) * tokens)
    flat = out.reshape((tokens * groups, out.shape[2]))
    flat[:] = 0.0
    sums = _block_sums(threads)
    _amx_project(q, s, steps, group_shift, xp, rows, np.arange(groups), tile_ptr, first, end, threads, sums,
                 np.empty((0, 0), np.float32), rows, np.ones(tokens * groups, np.float32), flat)
