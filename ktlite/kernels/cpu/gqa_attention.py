"""GQA decode and extend attention compiled for a CPU device, flash-style (the twins reference.gqa_extend_torch and
gqa_decode_torch are the spec; registered as their "cpu" implementation in ktlite/kernels/attention.py).

The twin builds a [tokens x context] score matrix per request, masks it and softmaxes it: at an 18k-token prompt
that is gigabytes per layer. Here a work item is (query block, kv head, key run): the block's queries of all the
kv head's query heads (group x block rows, so each K/V tile is read once for the whole group) walk the keys in
tiles of `key_tile` positions, gathered from the pool through req_to_token and decoded to fp32 (K transposed, V as
rows), and keep per row a running max, exp-sum and weighted V sum (online softmax, scores in log2 units). Rows go
four at a time through simd.vm_acc (scores = q rows x K^T, then P @ V, accumulators in registers, each tile vector
loaded once for the four rows); the row max (simd.row_max) and exp2 (simd.exp2_sum) are vector intrinsics too:
as plain numba loops these two stayed scalar and cost as much as both products. A row stops at its own causal
limit (prefix + its index + 1) and, with a sliding window, starts at its window: no mask. Sinks join each row's
denominator at the end (or in merge_runs). Items run in parallel (prange); where there are
fewer (query block x kv head) items than threads (decode at small batch, a short extend after a long prefix) each
item's keys are split into runs merged afterwards (flash-decoding, as attention.py does for MLA).
Decode and short extends (at most FEW_ROWS rows per kv head and request) at head dims >= DIRECT_DIM have too few rows
to pay for transposing tiles: there an item takes every kv head of its queries and reads each position's K and V rows
(all heads, contiguous in the pool) in place, a dot product per key and an axpy per value (attend_rows).

Pool layouts read in place: fp32 and bf16 K/V buffers [slots, Hkv, D] (bf16 as its uint16 bits, widened in the
kernel), and packed FP8 head rows [slots, Hkv, D + 4] uint8 (kv_fp8.head_rows: e4m3 codes through a 256-entry
table, times the row's fp32 scale, the same product the twin forms). Queries fp32, bf16 or fp16 (read as fp32);
the result is in q's dtype. fp32 FMAs at the vector width numba's target gives (kernels/cpu/target.py), bf16 pools
widened to fp32 in the gather; except that on a CPU with AMX-BF16 or AVX512-BF16 an extend over a bf16 or FP8 pool
whose longest request has at least TILE_MIN_ROWS rows runs in bf16 block products (attend_bf16_tiles, pool_products;
bf16_blocks.py: AMX tiles, else vdpbf16ps dots): queries, K, V and the probabilities in bf16, sums and softmax in
fp32, as the GPU kernels in a bf16 model. Its bound
(tests/test_cpu_gqa_attention.py): the twin over q, K and V rounded to bf16, within 2^-8 max |V| (the probabilities'
rounding moves an output by at most 2^-9 of the largest value it averages). 4k-token causal prefill at V2-Lite's
decompressed heads (16 x 192 / 128), 2 threads of a Sapphire Rapids VM: 1.25 ns a (query head, key) pair against
4.4 on fp32 products; at 16 x 128 / 128 0.79 (torch's bf16 flash attention, oneDNN: 0.63). On a Zen 5's AVX512-BF16
dots: 1.33 ns against 4.37, and 1.01 at 16 x 128 / 128, where torch's takes 3.66 (bench/cpu_attention.py).

Cost (2-core AVX2 EPYC, CPU time, indicative): extend ~1.5 ns per (query head, key) at head dim 16 (2.2 with one row
at a time and scalar max/exp), ~10 ns at 128 (17); decode at batch 1 ~1 ms for 18k positions (Hkv 2, group 2, head dim 16), ~5 ms for 4k (Hkv 8, group 4, head dim 128).

Bound (tests/test_cpu_gqa_attention.py): against the twin, |out - twin| <= 2e-5 + 2e-5 |twin| on fp32 outputs
(fp32 accumulation in another order, the exp2 polynomial's ~1e-7 relative error); with bf16/fp16 queries the
outputs are rounded to q's dtype, so one ulp of that dtype comes on top.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu import device_blocks
from ktlite.kernels.cpu.amx_kernels import cache_line_bytes
from ktlite.kernels.cpu.bf16_blocks import (
    BF16_PRODUCTS, FP32_PRODUCTS, bf16_block_scores, bf16_block_values, bf16_probabilities, interleave_rows,
)
from ktlite.kernels.cpu.simd import exp2_sum, row_max, to_bf16_bits, vm_acc
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer
from ktlite.kernels.triton.kv_fp8 import is_packed

ensure_threadsafe_layer()  # before the first parallel region of the process

ROWS_PER_ITEM = 256  # group x query block: rows sharing each decoded K/V tile
FEW_ROWS = 16  # calls of at most this many rows per kv head and request read K/V rows in place (attend_rows) ...
DIRECT_DIM = 64  # ... at head dims from this one (below, a dot product per key costs more than the tile's transpose)
TILE_MIN_ROWS = 32  # rows of a request (tokens x group) from which an extend takes bf16 block products
# bf16 block products: positions per gathered block (on AMX, P @ V four tile multiplies deep per load and store of
# the sums, and a row's softmax bookkeeping once per 128 scores), and rows (group x queries) per item, whose block of
# K / V is gathered once for all of them (V2-Lite's decompressed heads at 4k tokens on AMX, one thread: 64 / 256 ->
# 128 / 1024 took the call from 0.36 to 0.24 s)
KEY_BLOCK = 128
TILE_ROWS_PER_ITEM = 1024
TILE_FLOATS = 8192  # key_tile x head_dim of a decoded tile (32 KiB: an L1/L2 resident K tile)
_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_NO_SCALES = np.zeros((1, 1), np.float32)
_NO_SINKS = np.zeros(0, np.float32)

_F = np.float32
LOG2E, NEG = _F(1.4426950408889634), _F(-1e30)


def decode_row(buf, scales, lut, slot, head, row, row_bits):
    """row (fp32 [width]) <- kv head `head` of pool slot `slot`, decoded from the buffer's layout; row_bits: row's
    uint32 view."""


@overload(decode_row, jit_options={"fastmath": True})
def _decode_row(buf, scales, lut, slot, head, row, row_bits):
    if buf.dtype == types.uint8:  # packed FP8 head rows: e4m3 code x the row's scale
        def fp8(buf, scales, lut, slot, head, row, row_bits):
            src, scale = buf[slot, head], scales[slot, head]
            for d in range(row.shape[0]):
                row[d] = lut[src[d]] * scale
        return fp8
    if buf.dtype == types.uint16:  # bf16 bits: the high half of an fp32
        def bf16(buf, scales, lut, slot, head, row, row_bits):
            src = buf[slot, head]
            for d in range(row.shape[0]):
                row_bits[d] = np.uint32(src[d]) << np.uint32(16)
        return bf16

    def fp32(buf, scales, lut, slot, head, row, row_bits):
        src = buf[slot, head]
        for d in range(row.shape[0]):
            row[d] = src[d]
    return fp32


@njit(cache=True, fastmath=True)
def gather_tile(buf, scales, lut, slots, k0, nk, head, tile, row, row_bits):  # pragma: no cover - compiled
    """tile [width, key_tile] fp32 <- kv head `head` of positions k0..k0+nk of a request (slots: its req_to_token
    row), transposed (position j in column j); row/row_bits: one row's scratch and its uint32 view."""
    for j in range(nk):
        decode_row(buf, scales, lut, slots[k0 + j], head, row, row_bits)
        for d in range(row.shape[0]):
            tile[d, j] = row[d]


@njit(cache=True, fastmath=True)
def gather_rows(buf, scales, lut, slots, k0, nk, head, tile, tile_bits):  # pragma: no cover - compiled
    """tile [key_tile, width] fp32 <- kv head `head` of positions k0..k0+nk of a request, one row per position (the
    layout P @ V reads); tile_bits: tile's uint32 view."""
    for j in range(nk):
        decode_row(buf, scales, lut, slots[k0 + j], head, tile[j], tile_bits[j])


@njit(cache=True, fastmath=True)
def fold(sr, lo, hi, width, r, m, s_sum):  # pragma: no cover - compiled
    """Fold row r's scores sr[lo:hi] (the keys of this tile it sees) into its running max m[r] and exp-sum s_sum[r];
    sr[:width] (width a multiple of 16, >= hi) becomes its probabilities, zeros outside lo..hi. Returns the factor
    its output must be rescaled by."""
    if hi <= lo:
        sr[:width] = 0.0
        return np.float32(1.0)
    top = row_max(sr, lo, hi, m[r])
    alpha = np.exp2(m[r] - top)
    first, end = lo & ~15, (hi + 15) & ~15  # whole vectors: the lanes outside lo..hi score "none", exp2 0
    sr[first:lo] = NEG
    sr[hi:end] = NEG
    s_sum[r] = s_sum[r] * alpha + exp2_sum(sr, first, end, top)
    m[r] = top
    sr[:first] = 0.0
    sr[end:width] = 0.0
    return alpha


@njit(cache=True, fastmath=True)
def rescale(orow, alpha):  # pragma: no cover - compiled
    if alpha != 1.0:
        for e in range(orow.shape[0]):
            orow[e] *= alpha


@njit(cache=True, fastmath=True)
def attend_rows(qt, k, k_scales, v, v_scales, lut, slots, k0, nk, limit0, window, group, o, m, s_sum, st, row,
                row_bits):  # pragma: no cover - compiled
    """One key tile for an item of every kv head and few queries (decode): each position's K and V rows, all heads
    (contiguous in the pool), decoded once into `row` and used in place (a dot product per key, an axpy per value),
    where gathering transposed tiles head by head would cost more than the rows' arithmetic. Row r is query
    r // Hq, query head r % Hq (kv head (r % Hq) // group) and sees positions < limit0 + r // Hq (and, with a
    window, >= that limit - window); st [rows, key_tile] holds the scores."""
    n_rows, dim, dv, kv_heads = qt.shape[0], qt.shape[1], o.shape[1], k.shape[1]
    heads = kv_heads * group
    krow, kbits, vrow, vbits = row[:dim], row_bits[:dim], row[:dv], row_bits[:dv]
    seen = min(nk, limit0 + (n_rows - 1) // heads - k0)  # positions of this tile the item's last query sees
    for j in range(seen):
        for h in range(kv_heads):
            decode_row(k, k_scales, lut, slots[k0 + j], h, krow, kbits)
            for r in range(h * group, n_rows, heads):  # query by query, this kv head's group
                for g in range(r, r + group):
                    qr, acc = qt[g], np.float32(0.0)
                    for d in range(dim):
                        acc += qr[d] * krow[d]
                    st[g, j] = acc
    for r in range(n_rows):
        limit = limit0 + r // heads - k0
        lo = max(0, limit - window) if window > 0 else 0
        rescale(o[r], fold(st[r], lo, max(0, min(nk, limit)), (seen + 15) & ~15, r, m, s_sum))
    for j in range(seen):
        for h in range(kv_heads):
            decode_row(v, v_scales, lut, slots[k0 + j], h, vrow, vbits)
            for r in range(h * group, n_rows, heads):
                for g in range(r, r + group):
                    pj, orow = st[g, j], o[g]
                    for e in range(dv):
                        orow[e] += pj * vrow[e]


@njit(cache=True, fastmath=True)
def attend_tile(qt, kt, vtile, k0, nk, first_pos, window, group, o, m, s_sum, st, spare):
    # pragma: no cover - compiled
    """One decoded tile (kt [D, key_tile] transposed keys, vtile [key_tile, Dv] values of positions k0..k0+nk) for
    an item of one kv head: rows four at a time, simd.vm_acc streaming the tile once per four rows for the scores
    and for P @ V (with two, P @ V at head dim 16 was bound by its loads). Row r is query r // group (position
    first_pos + r // group); st [4, key_tile] holds the four rows' scores, spare [3, Dv] the outputs of the copies
    of the last row that pad a short last quad."""
    n_rows, dim, dv = qt.shape[0], qt.shape[1], o.shape[1]
    for r in range(0, n_rows, 4):
        last = min(r + 3, n_rows - 1)
        quad = (r, min(r + 1, last), min(r + 2, last), last)
        n = max(0, min(nk, first_pos + last // group + 1 - k0))  # the last row sees furthest
        if n == 0:
            continue  # every row's causal limit is before this tile
        width = (n + 15) & ~15
        st[:, :width] = 0.0
        vm_acc((qt[quad[0]], qt[quad[1]], qt[quad[2]], qt[quad[3]]), kt, (st[0], st[1], st[2], st[3]), dim, width)
        for i in range(4):
            if i > 0 and quad[i] == quad[i - 1]:
                st[i, :width] = 0.0  # a padding copy: adds nothing to its spare output
                continue
            limit = first_pos + quad[i] // group + 1 - k0  # past the row's last key
            lo = max(0, limit - window) if window > 0 else 0
            rescale(o[quad[i]], fold(st[i], lo, max(0, min(nk, limit)), width, quad[i], m, s_sum))
        outs = (o[r], o[quad[1]] if r + 1 <= last else spare[0], o[quad[2]] if r + 2 <= last else spare[1],
                o[last] if r + 3 <= last else spare[2])
        vm_acc((st[0], st[1], st[2], st[3]), vtile, outs, n, dv)


@njit(cache=True, fastmath=True)
def attend_fp32(q, first, h, group, item_heads, nq, k, k_scales, v, v_scales, lut, slots, lo, hi, first_pos, window,
                scale2, dv, key_tile, direct, m, s_sum):  # pragma: no cover - compiled
    """An item in fp32 products: returns its unnormalised outputs o [rows, Dv] (row r = query r // item_heads,
    query head h * group + r % item_heads), m and s_sum updated; its keys lo..hi in tiles of key_tile, transposed
    (gather_tile, attend_tile) or, with `direct`, read in place (attend_rows)."""
    dim, n_rows = q.shape[2], nq * item_heads
    o = np.zeros((n_rows, dv), np.float32)
    qt = np.empty((n_rows, dim), np.float32)
    for r in range(n_rows):
        for d in range(dim):
            qt[r, d] = q[first + r // item_heads, h * group + r % item_heads, d] * scale2
    kt = np.empty((dim, key_tile), np.float32)
    vtile = np.empty((key_tile, dv), np.float32)
    vtile_bits = vtile.view(np.uint32)
    spare = np.empty((3, dv), np.float32)
    row = np.empty(max(dim, dv), np.float32)
    row_bits = row.view(np.uint32)
    st = np.empty((n_rows if direct else 4, key_tile), np.float32)
    for k0 in range(lo, hi, key_tile):
        nk = min(key_tile, hi - k0)
        if direct:
            attend_rows(qt, k, k_scales, v, v_scales, lut, slots, k0, nk, first_pos + 1, window, group, o, m, s_sum,
                        st, row, row_bits)
            continue
        gather_tile(k, k_scales, lut, slots, k0, nk, h, kt, row[:dim], row_bits[:dim])
        gather_rows(v, v_scales, lut, slots, k0, nk, h, vtile, vtile_bits)
        attend_tile(qt, kt, vtile, k0, nk, first_pos, window, group, o, m, s_sum, st, spare)
    return o


@njit(cache=True)
def _tile_array(rows, cols, dtype):  # pragma: no cover - compiled
    """A zeroed [rows, cols] array starting on a cache line (AMX tile rows must not straddle two lines)."""
    a = cache_line_bytes(4 * rows * cols).view(dtype)[: rows * cols].reshape((rows, cols))  # 4: the widest dtype
    a[:] = 0
    return a


def bf16_row(buf, scales, lut, slot, head, row, row_bits, out):  # pragma: no cover - replaced by the overload
    """out (uint16 [>= width, a multiple of 16]) <- the bf16 bits of kv head `head` of pool slot `slot`: a bf16
    pool's own row, other layouts decoded (decode_row into row / row_bits, zero past the width) and rounded."""


@overload(bf16_row, jit_options={"fastmath": True})
def _bf16_row(buf, scales, lut, slot, head, row, row_bits, out):
    if buf.dtype == types.uint16:
        def bf16(buf, scales, lut, slot, head, row, row_bits, out):
            src = buf[slot, head]
            for d in range(src.shape[0]):  # a loop: numba's slice assignment checks for overlap (a copy) per call
                out[d] = src[d]
        return bf16

    def rounded(buf, scales, lut, slot, head, row, row_bits, out):
        width = row_bits.shape[0]
        decode_row(buf, scales, lut, slot, head, row[:width], row_bits)
        for d in range(width, out.shape[0]):
            row[d] = 0.0
        to_bf16_bits(row, out, out.shape[0])
    return rounded


@njit(cache=True, fastmath=True)
def attend_bf16_tiles(q, first, h, group, nq, k, k_scales, v, v_scales, lut, slots, lo, hi, first_pos, window,
                      scale2, dv, m, s_sum, kind):  # pragma: no cover - compiled
    """An item of one kv head in bf16 block products (bf16_blocks: AMX-BF16 tiles or AVX512-BF16 dots by `kind`):
    returns its unnormalised outputs o [rows rounded up to 32, Dv rounded up to 32] (row r = query r // group, query
    head h * group + r % group, as attend_tile's), m and s_sum updated. Queries as bf16 (exact for a bf16 model's), unscaled; each block of KEY_BLOCK positions is gathered
    once into the tiles' VNNI layouts (K: a key's dims in pairs, one 32-bit word a pair, key by key; V: two keys'
    rows interleaved), then per 32 rows the scores (bf16_block_scores), the online softmax in fp32 with the
    probabilities rounded to bf16 (bf16_probabilities), and P @ V onto the rescaled outputs (bf16_block_values)."""
    dim, n_rows = q.shape[2], nq * group
    dp, dvp = (dim + 31) & ~31, (dv + 31) & ~31
    qb = _tile_array((n_rows + 31) & ~31, dp, np.uint16)
    kt = _tile_array(dp // 2, 2 * KEY_BLOCK, np.uint16)
    ktw = kt.view(np.uint32)  # [dp / 2, KEY_BLOCK]: a key's dim pair per word
    vv = _tile_array(KEY_BLOCK // 2, 2 * dvp, np.uint16)
    st = _tile_array(32, KEY_BLOCK, np.float32)
    pb = _tile_array(32, KEY_BLOCK, np.uint16)
    o = _tile_array(qb.shape[0], dvp, np.float32)
    row = np.zeros(max(dp, dvp), np.float32)
    row_bits = row.view(np.uint32)
    k16, v16 = np.zeros(dp, np.uint16), np.zeros((2, dvp), np.uint16)
    k16w = k16.view(np.uint32)
    lo_rows, hi_rows = np.zeros(32, np.int64), np.zeros(32, np.int64)
    for r in range(n_rows):
        row[:dim] = q[first + r // group, h * group + r % group]
        to_bf16_bits(row, qb[r], dp)
    for k0 in range(lo, hi, KEY_BLOCK):
        nk = min(KEY_BLOCK, hi - k0)
        for j in range(0, nk, 2):
            for t in range(2):
                if j + t < nk:
                    bf16_row(k, k_scales, lut, slots[k0 + j + t], h, row, row_bits[:dim], k16)
                    for i in range(dp // 2):
                        ktw[i, j + t] = k16w[i]
                    bf16_row(v, v_scales, lut, slots[k0 + j + t], h, row, row_bits[:dv], v16[t])
                else:  # an odd block's last pair: probability 0, but 0 x a stale value may be NaN
                    v16[t] = 0
            interleave_rows(v16[0], v16[1], vv[j // 2], dvp)
        for r0 in range(0, n_rows, 32):
            n = min(32, n_rows - r0)
            for i in range(n):
                limit = first_pos + (r0 + i) // group + 1 - k0  # past the row's last key in this block
                lo_rows[i], hi_rows[i] = max(0, limit - window) if window > 0 else 0, max(0, min(nk, limit))
            width = (hi_rows[n - 1] + 31) & ~31  # the last row sees furthest
            if width == 0:
                continue
            for c0 in range(0, width, 32):
                bf16_block_scores(qb, r0, kt, c0, dp // 32, st, kind)
            bf16_probabilities(st, pb, o, r0, n, lo_rows, hi_rows, width, scale2, m, s_sum)
            for c0 in range(0, dvp, 32):
                bf16_block_values(pb, vv, c0, width // 32, o, r0, kind)
    return o


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def gqa_attention(q, k, k_scales, v, v_scales, lut, req_to_token, rows, prefix, lens, starts, blk_req, blk_q0,
                  block, key_tile, runs, direct, products, sm_scale, window, sinks2, out, part_o, part_ml):
    # pragma: no cover - compiled
    """out [N, Hq, Dv] fp32 <- causal GQA of q [N, Hq, D] (fp32) over the pool (layouts in the module docstring).
    Request b's queries are rows starts[b].. of q, at positions prefix[b]..prefix[b] + lens[b] - 1 of its
    req_to_token row rows[b]; query blocks (blk_req, blk_q0) of up to `block` queries; `runs` key runs per item,
    whose partial sums go through part_o [runs, N, Hq, Dv] and part_ml [runs, N, Hq, 2] (max, exp-sum) when > 1.
    window > 0: a query sees its last `window` positions only; sinks2 [Hq] (or empty): the sinks in log2 units.
    An item takes one kv head and its tiles (attend_fp32; with bf16 `products`, attend_bf16_tiles), or with `direct`
    every kv head, reading each position's K/V rows of all heads (contiguous in the pool) in place."""
    heads = q.shape[1]
    kv_heads, dv = k.shape[1], out.shape[2]
    group = heads // kv_heads
    item_kv = kv_heads if direct else 1  # kv heads per item
    item_heads = item_kv * group  # query heads per item
    scale2 = np.float32(sm_scale) * LOG2E  # scores in log2 units: exp2 below
    per_block = kv_heads // item_kv * runs
    for item in prange(blk_req.shape[0] * per_block):
        blk, h, run = item // per_block, (item % per_block) // runs * item_kv, item % runs
        b, q0 = blk_req[blk], blk_q0[blk]
        nq = min(block, lens[b] - q0)
        n_rows, first = nq * item_heads, starts[b] + q0
        m = np.full(n_rows, NEG, np.float32)
        s_sum = np.zeros(n_rows, np.float32)
        first_pos = prefix[b] + q0
        seen = first_pos + nq  # positions the block's last query sees
        start = max(0, first_pos + 1 - window) if window > 0 else 0  # the first query's window
        span = (seen - start + runs - 1) // runs
        lo, hi = start + run * span, min(seen, start + (run + 1) * span)
        slots = req_to_token[rows[b]]
        if products != FP32_PRODUCTS:
            o = attend_bf16_tiles(q, first, h, group, nq, k, k_scales, v, v_scales, lut, slots, lo, hi, first_pos,
                                  window, scale2, dv, m, s_sum, products)
        else:
            o = attend_fp32(q, first, h, group, item_heads, nq, k, k_scales, v, v_scales, lut, slots, lo, hi,
                            first_pos, window, scale2, dv, key_tile, direct, m, s_sum)
        for r in range(n_rows):
            t, hq = first + r // item_heads, h * group + r % item_heads
            if runs == 1:  # every row saw at least its own position: s_sum > 0
                top, total = m[r], s_sum[r]
                if sinks2.shape[0]:  # the sink joins the denominator, at a common max
                    top = max(m[r], sinks2[hq])
                    total = s_sum[r] * np.exp2(m[r] - top) + np.exp2(sinks2[hq] - top)
                inv = np.exp2(m[r] - top) / total
                for e in range(dv):
                    out[t, hq, e] = o[r, e] * inv
            else:
                part_ml[run, t, hq, 0], part_ml[run, t, hq, 1] = m[r], s_sum[r]
                for e in range(dv):
                    part_o[run, t, hq, e] = o[r, e]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def merge_runs(part_o, part_ml, sinks2, out):  # pragma: no cover - compiled
    """out[t, h] <- the runs' partial sums rescaled to their common max, over their total exp-sum (plus the head's
    sink, sinks2 in log2 units, where given)."""
    runs, n_tok, heads, dv = part_o.shape
    for item in prange(n_tok * heads):
        t, h = item // heads, item % heads
        top = sinks2[h] if sinks2.shape[0] else NEG
        for r in range(runs):
            if part_ml[r, t, h, 1] > 0.0:
                top = max(top, part_ml[r, t, h, 0])
        total = np.exp2(sinks2[h] - top) if sinks2.shape[0] else np.float32(0.0)
        for e in range(dv):
            out[t, h, e] = 0.0
        for r in range(runs):
            if part_ml[r, t, h, 1] == 0.0:  # a run past this row's causal limit
                continue
            w = np.exp2(part_ml[r, t, h, 0] - top)
            total += w * part_ml[r, t, h, 1]
            for e in range(dv):
                out[t, h, e] += w * part_o[r, t, h, e]
        for e in range(dv):
            out[t, h, e] /= total


def accepts(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, *args: object, sinks: object = None,
            window: int = 0) -> bool:
    """Whether gqa_extend / gqa_decode take these inputs (else the twin does): CPU, fp32/bf16/fp16 queries, K and V
    both fp32, both bf16 or both packed FP8 rows, unit stride along the head dim."""
    return (q.device.type == "cpu" and q.dtype in _Q_DTYPES and k_buffer.dtype == v_buffer.dtype
            and k_buffer.dtype in _POOL_DTYPES and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1)


def pool_products(k_buffer: torch.Tensor) -> int:
    """How an extend over this pool multiplies (bf16_blocks' kinds): in bf16 block products where the CPU has
    them (AMX-BF16 tiles, else AVX512-BF16 dots) and the pool holds bf16 or FP8 values (bf16 products then lose only
    the queries' and probabilities' rounding to bf16, as the GPU kernels do in a bf16 model); fp32 pools keep fp32
    products, the exact reference setting."""
    return BF16_PRODUCTS if k_buffer.dtype == torch.bfloat16 or is_packed(k_buffer) else FP32_PRODUCTS


def _pool(buffer: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    """(values as the kernel reads them, fp32 scales [slots, Hkv] of packed rows, head width) of a K or V buffer."""
    if is_packed(buffer):
        width = buffer.shape[-1] - 4
        return buffer.numpy(), buffer.view(torch.float32)[..., width // 4].numpy(), width
    if buffer.dtype == torch.bfloat16:
        return buffer.view(torch.int16).numpy().view(np.uint16), _NO_SCALES, buffer.shape[-1]
    return buffer.numpy(), _NO_SCALES, buffer.shape[-1]


def query_blocks(prefix: np.ndarray, lens: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, first query) of each block of up to `block` queries, in snake order of cost (largest, smallest,
    next largest, ...): the causal blocks' work grows with position, and contiguous shares of this order even out
    under static and dynamic scheduling alike."""
    per_req = -(-lens // block)
    req = np.repeat(np.arange(lens.shape[0]), per_req)
    q0 = (np.arange(req.shape[0]) - np.repeat(np.cumsum(per_req) - per_req, per_req)) * block
    order = np.argsort(-(prefix[req] + q0), kind="stable")
    snake = np.empty_like(order)
    snake[0::2], snake[1::2] = order[: (order.shape[0] + 1) // 2], order[(order.shape[0] + 1) // 2:][::-1]
    return req[snake], q0[snake]


def gqa_extend(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float,
               sinks: torch.Tensor | None = None, window: int = 0, runs: int | None = None,
               products: int | None = None) -> torch.Tensor:
    """reference.gqa_extend_torch's signature and result ([N, Hq, Dv] in q's dtype); `runs` overrides the key
    runs per item, `products` the kind of products (pool_products) for the calls that do not read rows in place
    (tests)."""
    sinks2 = _NO_SINKS if sinks is None else (sinks.float() * float(LOG2E)).contiguous().numpy()
    k, k_scales, dim = _pool(k_buffer)
    v, v_scales, dv = _pool(v_buffer)
    out = np.zeros((q.shape[0], q.shape[1], dv), np.float32)
    if q.shape[0] == 0:
        return torch.from_numpy(out).to(q.dtype)
    prefix, lens = prefix_lens.to(torch.int64).numpy(), extend_lens.to(torch.int64).numpy()
    group = q.shape[1] // k.shape[1]
    # decode and short extends at head dims where a dot product per key beats transposing tiles: rows in place
    direct = int(lens.max()) * group <= FEW_ROWS and dim >= DIRECT_DIM
    # bf16 blocks where a request fills a block's 32 rows (decode's few rows would mostly multiply padding)
    if products is None:
        products = pool_products(k_buffer) if int(lens.max()) * group >= TILE_MIN_ROWS else FP32_PRODUCTS
    if direct:
        products = FP32_PRODUCTS
    block = max(1, (ROWS_PER_ITEM if products == FP32_PRODUCTS else TILE_ROWS_PER_ITEM) // group)
    blk_req, blk_q0 = query_blocks(prefix, lens, block)
    if runs is None:
        longest = int((prefix + np.minimum(lens, block)).max())
        if window > 0:
            longest = min(longest, window + block)
        items = blk_req.shape[0] * (1 if direct else k.shape[1])
        runs = device_blocks.decode_splits(items, longest, numba.config.NUMBA_NUM_THREADS)
    many = runs > 1
    part_o = np.empty((runs if many else 0, *out.shape), np.float32)
    part_ml = np.empty((runs if many else 0, q.shape[0], q.shape[1], 2), np.float32)
    starts = np.cumsum(lens) - lens
    gqa_attention(q.float().contiguous().numpy(), k, k_scales, v, v_scales, _E4M3, req_to_token.numpy(),
                  req_pool_indices.to(torch.int64).numpy(), prefix, lens, starts, blk_req, blk_q0, block,
                  max(64, min(256, TILE_FLOATS // max(dim, dv))) & ~15, runs, direct,
                  products, sm_scale, window, sinks2, out, part_o, part_ml)
    if many:
        merge_runs(part_o, part_ml, sinks2, out)
    return torch.from_numpy(out).to(q.dtype)


def gqa_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
               sinks: torch.Tensor | None = None, window: int = 0, runs: int | None = None) -> torch.Tensor:
    """reference.gqa_decode_torch's signature and result: the extend kernel with one query per request."""
    return gqa_extend(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens - 1, torch.ones_like(seq_lens),
                      sm_scale, sinks, window, runs)
