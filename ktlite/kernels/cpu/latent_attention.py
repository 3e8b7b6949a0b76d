"""Absorbed-MLA attention over the latent pool, compiled for a CPU device: decode, extend and sparse (DSA).

The torch twins (reference.mla_decode_torch / mla_extend_torch / sparse_mla_torch) are the spec. All three
kinds run the same flash-style step, `_attend_block`: a group of query rows (tokens x heads of one request, all
scaled by sm_scale log2(e): scores in log2 units, for simd.exp2_sum) folds one block of BLOCK decoded latents into
its online-softmax state (each row's max, exp-sum and unnormalised output); scores and probabilities live only for that block, and a row's causal limit
cuts its block short: no [tokens x context] score matrix, no masks. Extend decodes each request's visible
latents once (`_decode_requests`, fp32 tiles and their transposes, in parallel) for all its work items (ROWS
query rows each, dealt to the threads); decode (flash-decoding runs, merged after) and sparse attention (each
query's own slots) decode a block per work item as they go (`_attend`).

The pool is read in place, one row at a time, by `latent_row`: plain fp32 rows, bf16 rows (uint16 bits, shifted
into fp32) or the packed FP8 rows of kv_fp8.latent_rows, passed as its three views (e4m3 bytes, an fp32 scale per
group of values, the rope'd key's bf16 bits) and the group size: the one place these kernels decode a latent.

The arithmetic is simd.vm_acc (acc += a @ M for two query rows at once, 64 accumulator lanes held in registers
across the block: each vector of M loaded serves both rows), for the scores (q rows against the transposed tile)
and for P @ V (the probabilities against the tile's first kv_lora columns). fp32 FMAs throughout, on every CPU
(AVX2 here; LLVM widens the 16-lane vectors to zmm where AVX-512 exists); no bf16 dot-product path yet.

Softmax state starts at a finite _NONE instead of -inf: the kernels are built with fast-math flags that allow
reassociation and contraction, not the no-infinities flag that would let LLVM drop -inf comparisons.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu.simd import exp2_sum, row_max, vm_acc
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process

BLOCK = 64  # latent positions per block: the tile (64 x 576 fp32, 147 KB) and its transpose stay in L2
ROWS = 64  # query rows (tokens x heads) per work item of extend / sparse: each decoded block serves them all
_NONE = np.float32(-1e30)
_LOG2E = np.float32(1.4426950408889634)  # "no score yet" (see the module docstring)
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


def _e4m3_values() -> np.ndarray:
    """fp32 value of each float8_e4m3fn bit pattern (sign, 4 exponent bits biased by 7, 3 mantissa bits; 0x7f
    and 0xff NaN), as torch's .float() gives them."""
    bits = np.arange(256)
    exp, mant = (bits >> 3) & 15, (bits & 7).astype(np.float64)
    mag = np.where(exp == 0, mant / 8 * 2.0**-6, (1 + mant / 8) * 2.0 ** (exp - 7))
    mag = np.where((bits & 127) == 127, np.nan, mag)
    return np.where(bits & 128, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def latent_row(pool, slot, out):  # pragma: no cover - replaced by the overload in jit code
    raise NotImplementedError("latent_row is only callable from numba-compiled code")


@overload(latent_row, inline="always")
def _latent_row_impl(pool, slot, out):
    """out[:kv_lora + rope] = the fp32 latent of pool slot `slot`; pool: fp32 [slots, W], bf16 bits uint16
    [slots, W], or the packed rows' views and their group size (e4m3 uint8 [slots, kv_lora], fp32 scales
    [slots, groups], bf16 bits uint16 [slots, rope], values per scale)."""
    if isinstance(pool, types.Array) and pool.dtype == types.float32:
        def plain(pool, slot, out):
            src = pool[slot]
            for d in range(src.shape[0]):
                out[d] = src[d]
        return plain
    if isinstance(pool, types.Array) and pool.dtype == types.uint16:
        def bf16(pool, slot, out):
            src, bits = pool[slot], out.view(np.uint32)
            for d in range(src.shape[0]):
                bits[d] = np.uint32(src[d]) << np.uint32(16)
        return bf16
    if isinstance(pool, types.BaseTuple) and len(pool) == 4:
        def packed(pool, slot, out):
            values, scales, tail, group = pool[0][slot], pool[1][slot], pool[2][slot], pool[3]
            dim, bits = values.shape[0], out.view(np.uint32)
            for g in range(scales.shape[0]):
                scale = scales[g]
                for d in range(g * group, min(dim, (g + 1) * group)):
                    out[d] = E4M3_VALUES[values[d]] * scale
            for d in range(tail.shape[0]):
                bits[dim + d] = np.uint32(tail[d]) << np.uint32(16)
        return packed
    return None


@njit(nogil=True, cache=True, fastmath=_FAST)
def _online_softmax(s, n, r, m, l, o):  # pragma: no cover - compiled
    """Fold row r's scores s[:n] of one block (log2 units) into its running max m[r] and exp-sum l[r], rescale its
    output o[r] to the new max, and turn s[:n] into the block's probabilities (s has room for n rounded up to 16:
    those lanes score "none", exp2 0)."""
    top = row_max(s, 0, n, m[r])
    end = (n + 15) & ~15
    s[n:end] = _NONE
    total = exp2_sum(s, 0, end, top)
    shrink = np.exp2(m[r] - top)
    l[r] = l[r] * shrink + total
    m[r] = top
    if shrink != 1.0:
        for d in range(o.shape[1]):
            o[r, d] *= shrink


@njit(nogil=True, cache=True)
def _decode_block(pool, slots, tile, kt):  # pragma: no cover - compiled
    """The latents of slots (at most BLOCK) into tile [BLOCK, W] fp32 and its transpose kt [W, BLOCK]."""
    width = tile.shape[1]
    for j in range(slots.shape[0]):
        latent_row(pool, slots[j], tile[j])
    for d0 in range(0, width, 16):  # 16 rows of kt at a time: they stay in L1 while the tile rows pass
        for j in range(slots.shape[0]):
            for d in range(d0, min(width, d0 + 16)):
                kt[d, j] = tile[j, d]


@njit(nogil=True, cache=True, fastmath=_FAST)
def _attend_block(qb, limits, j0, nb, tile, kt, m, l, o):  # pragma: no cover - compiled
    """Fold one decoded block (positions j0..j0 + nb: tile, kt as _decode_block's) into the flash state of query
    rows qb [R, W] (already times sm_scale log2(e); row r sees positions < limits[r]): running max m [R], exp-sum l [R],
    unnormalised output o [R, kv_lora]."""
    rows, width = qb.shape
    s = np.zeros((2, BLOCK), np.float32)
    spare = np.empty((1, o.shape[1]), np.float32)  # the partner of an odd last row
    for r in range(0, rows, 2):  # rows in pairs: vm_acc streams the tile once per pair
        pair = r + 1 < rows
        r1 = r + 1 if pair else r
        n0 = max(0, min(nb, limits[r] - j0))
        n1 = max(0, min(nb, limits[r1] - j0)) if pair else 0
        n = max(n0, n1)
        if n == 0:
            continue
        s[:] = 0.0
        vm_acc((qb[r], qb[r1]), kt, (s[0], s[1]), width, (n + 15) & ~15)
        _online_softmax(s[0], n0, r, m, l, o)
        s[0, n0:] = 0.0  # a row's probabilities past its causal limit (its partner's may reach further)
        if pair:
            _online_softmax(s[1], n1, r1, m, l, o)
        s[1, n1:] = 0.0
        vm_acc((s[0], s[1]), tile, (o[r], o[r1] if pair else spare[0]), n, o.shape[1])


@njit(nogil=True, cache=True)
def _start(m, l, o):  # pragma: no cover - compiled
    m[:] = _NONE
    l[:] = 0.0
    o[:] = 0.0


@njit(nogil=True, cache=True)
def _attend(qb, limits, pool, slots, m, l, o):  # pragma: no cover - compiled
    """Flash attention of query rows qb [R, W] over the latents of `slots`, decoding each block once for all rows
    (limits, m, l, o as _attend_block's; l = 0 for a row that saw nothing)."""
    tile = np.empty((BLOCK, qb.shape[1]), np.float32)
    kt = np.zeros((qb.shape[1], BLOCK), np.float32)
    _start(m, l, o)
    for j0 in range(0, slots.shape[0], BLOCK):
        nb = min(BLOCK, slots.shape[0] - j0)
        _decode_block(pool, slots[j0:j0 + nb], tile, kt)
        _attend_block(qb, limits, j0, nb, tile, kt, m, l, o)


@njit(nogil=True, cache=True)
def _scaled_rows(q, heads, sm_scale, qb):  # pragma: no cover - compiled
    """qb[i * len(heads) + k] = q[i, heads[k]] * sm_scale * log2(e) for q [T, H, W] (a work item's query rows):
    scores in log2 units, for exp2."""
    scale = np.float32(sm_scale * _LOG2E)
    for i in range(q.shape[0]):
        for k in range(heads.shape[0]):
            for d in range(q.shape[2]):
                qb[i * heads.shape[0] + k, d] = q[i, heads[k], d] * scale


@njit(nogil=True, cache=True)
def _normalised(o, l, out):  # pragma: no cover - compiled
    """out[r] = o[r] / l[r] (zeros where l[r] = 0: a row that saw no position), out viewed as [R, kv_lora]."""
    for r in range(o.shape[0]):
        inv = np.float32(1.0) / l[r] if l[r] > 0.0 else np.float32(0.0)
        for d in range(o.shape[1]):
            out[r, d] = o[r, d] * inv


@njit(parallel=True, nogil=True, cache=True)
def _decode_requests(pool, req_to_token, rows, seen, first_block, tiles, kts):  # pragma: no cover - compiled
    """Every block of every request's visible positions (seen[b] of row rows[b]) decoded once, in parallel:
    request b's block i into tiles / kts [first_block[b] + i] (a request without new tokens has none: it shares
    its first_block with the next, and the search picks the last request starting there)."""
    for k in prange(tiles.shape[0]):
        b = np.searchsorted(first_block, k, side="right") - 1
        j0 = (k - first_block[b]) * BLOCK
        _decode_block(pool, req_to_token[rows[b], j0:min(seen[b], j0 + BLOCK)], tiles[k], kts[k])


@njit(parallel=True, nogil=True, cache=True)
def _run_items(items, q, tiles, kts, prefix_lens, starts, first_block, sm_scale, kv_lora, group, threads,
               out):  # pragma: no cover - compiled
    """mla_extend_latents' work items, item i = (request b, first token t0, tokens, first head): dealt to the
    threads round-robin (with causal attention a request's later tokens see more positions, so contiguous
    ranges of items would load the threads unevenly; each item's result depends on nothing but its inputs)."""
    heads = q.shape[1]
    for w in prange(threads):
        for i in range(w, items.shape[0], threads):
            b, t0, count, h0 = items[i, 0], items[i, 1], items[i, 2], items[i, 3]
            h1 = min(heads, h0 + group)
            first = starts[b] + t0
            nrows = count * (h1 - h0)
            qb = np.empty((nrows, q.shape[2]), np.float32)
            _scaled_rows(q[first:first + count], np.arange(h0, h1), sm_scale, qb)
            limits = np.empty(nrows, np.int64)
            for r in range(nrows):
                limits[r] = prefix_lens[b] + t0 + r // (h1 - h0) + 1
            m, l = np.empty(nrows, np.float32), np.empty(nrows, np.float32)
            o = np.empty((nrows, kv_lora), np.float32)
            _start(m, l, o)
            seen = prefix_lens[b] + t0 + count
            for j0 in range(0, seen, BLOCK):
                k = first_block[b] + j0 // BLOCK
                _attend_block(qb, limits, j0, min(BLOCK, seen - j0), tiles[k], kts[k], m, l, o)
            res = np.empty((nrows, kv_lora), np.float32)
            _normalised(o, l, res)
            for r in range(nrows):
                out[first + r // (h1 - h0), h0 + r % (h1 - h0)] = res[r]


@njit(nogil=True, cache=True)
def mla_extend_latents(q, pool, req_to_token, rows, prefix_lens, extend_lens, sm_scale, kv_lora, threads,
                       out):  # pragma: no cover - compiled
    """Absorbed-MLA causal extend (reference.mla_extend_torch): out [N, H, kv_lora] fp32 from q [N, H, W] fp32
    (requests' tokens concatenated in order); token i of request b sees positions 0..prefix_lens[b] + i of its
    req_to_token row rows[b]. Each request's latents are decoded once (fp32 tiles and their transposes, 2 x 4 x W
    bytes per position), then a work item is up to ROWS query rows: ROWS // heads tokens x all heads, or one token
    x a group of ROWS heads; `threads`: how many threads share them (the result does not depend on it)."""
    batch, (tokens, heads, width) = extend_lens.shape[0], q.shape
    group = min(heads, ROWS)
    per_item = max(1, ROWS // group)
    groups = (heads + group - 1) // group
    starts = np.zeros(batch, np.int64)
    starts[1:] = np.cumsum(extend_lens)[:-1]
    seen = prefix_lens + extend_lens
    first_block = np.zeros(batch + 1, np.int64)  # request b's blocks: first_block[b] .. first_block[b + 1]
    first_block[1:] = np.cumsum(np.where(extend_lens > 0, (seen + BLOCK - 1) // BLOCK, 0))
    total = 0
    for b in range(batch):
        total += (extend_lens[b] + per_item - 1) // per_item * groups
    tiles = np.empty((first_block[batch], BLOCK, width), np.float32)
    kts = np.zeros((first_block[batch], width, BLOCK), np.float32)
    _decode_requests(pool, req_to_token, rows, seen, first_block, tiles, kts)
    items = np.empty((total, 4), np.int64)
    i = 0
    for b in range(batch):
        for t0 in range(0, extend_lens[b], per_item):
            for g in range(groups):
                items[i, 0], items[i, 1] = b, t0
                items[i, 2], items[i, 3] = min(per_item, extend_lens[b] - t0), g * group
                i += 1
    _run_items(items, q, tiles, kts, prefix_lens, starts, first_block, sm_scale, kv_lora, group, threads, out)


@njit(parallel=True, nogil=True, cache=True)
def mla_decode_latents(q, pool, req_to_token, rows, lens, sm_scale, kv_lora, runs, out):  # pragma: no cover - compiled
    """Absorbed-MLA decode (reference.mla_decode_torch): out [B, H, kv_lora] from q [B, H, W] fp32 over the first
    lens[b] positions of req_to_token row rows[b]. Each request's positions are split into `runs` runs (flash-
    decoding: batch-1 decode still uses every thread), each attended by all heads at once; a second pass merges
    the runs' (max, exp-sum, output)."""
    batch, heads, width = q.shape
    run_max = np.full((batch, runs, heads), _NONE, np.float32)
    run_sum = np.zeros((batch, runs, heads), np.float32)
    run_out = np.zeros((batch, runs, heads, kv_lora), np.float32)
    every = np.arange(heads)
    for item in prange(batch * runs):
        b, r = item // runs, item % runs
        length = (lens[b] + runs - 1) // runs
        lo, hi = r * length, min(lens[b], (r + 1) * length)
        if lo >= hi:
            continue
        qb = np.empty((heads, width), np.float32)
        _scaled_rows(q[b:b + 1], every, sm_scale, qb)
        limits = np.full(heads, hi - lo, np.int64)
        _attend(qb, limits, pool, req_to_token[rows[b], lo:hi], run_max[b, r], run_sum[b, r], run_out[b, r])
    for item in prange(batch * heads):  # merge the runs: rescale each to the overall max
        b, h = item // heads, item % heads
        top = run_max[b, :, h].max()
        total = np.float32(0.0)
        out[b, h] = 0.0
        for r in range(runs):
            if run_sum[b, r, h] == 0.0:
                continue
            scale = np.exp2(run_max[b, r, h] - top)
            total += scale * run_sum[b, r, h]
            for d in range(kv_lora):
                out[b, h, d] += scale * run_out[b, r, h, d]
        if total > 0.0:
            for d in range(kv_lora):
                out[b, h, d] /= total


@njit(parallel=True, nogil=True, cache=True)
def sparse_mla_latents(q, pool, topk_slots, sm_scale, kv_lora, out):  # pragma: no cover - compiled
    """Absorbed MLA over each query's own selected slots (reference.sparse_mla_torch, DSA): out [N, H, kv_lora]
    from q [N, H, W] fp32 and topk_slots [N, K] (-1 = none, skipped; a query with none gets zeros). A work item is
    one query x a group of up to ROWS heads: every selected latent is decoded once for the group."""
    tokens, heads, width = q.shape
    group = min(heads, ROWS)
    groups = (heads + group - 1) // group
    for item in prange(tokens * groups):
        t, h0 = item // groups, item % groups * group
        h1 = min(heads, h0 + group)
        chosen = topk_slots[t]
        slots = chosen[chosen >= 0]
        qb = np.empty((h1 - h0, width), np.float32)
        _scaled_rows(q[t:t + 1], np.arange(h0, h1), sm_scale, qb)
        limits = np.full(h1 - h0, slots.shape[0], np.int64)
        m, l = np.empty(h1 - h0, np.float32), np.empty(h1 - h0, np.float32)
        o = np.empty((h1 - h0, kv_lora), np.float32)
        _attend(qb, limits, pool, slots, m, l, o)
        _normalised(o, l, out[t, h0:h1])
