"""The routed experts' kernels (moe.py's CPUMoE calls them, and reads a few tile constants here too).

`moe_rows` is the fused routed-expert MLP for few tokens (per-expert GEMV, parallel over output
rows). One call runs every selected expert of one layer (one pool's share) in two parallel regions:
  1. gate/up rows: act[p, i] = A(gate_i . x_t, up_i . x_t) for each (token t, expert) pair p, A the experts'
     activation (kernels/expert_activation.py: SiLU(gate) * up, or its clamped forms, after the gate/up bias);
  2. down rows:    out[t, h] += w_p * (down_h . act[p] (+ the down bias)).
Each row is dotted straight from its stored bytes with every token routed to that expert (the row
stays in L1 between tokens, so weights stream from RAM once per call however many tokens share an
expert); an expert with DECODE_ONCE_TOKENS or more tokens decodes each row once into an fp32
buffer and dots that with each token instead. Rows are split in chunks across threads; a thread
owns whole rows of `act`/`out`, so there are no races. For many tokens gemm.py's dequantize + oneDNN path is the
faster one; `scatter_add_bf16` adds its bf16 expert outputs, weighted, into the fp32 result.

`moe_rows_routed` groups the router's ids by expert (`group_pairs`), then runs moe_rows and, on AMX tiles,
amx_kernels.moe_amx.
"""

from __future__ import annotations

import numpy as np
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ktlite.kernels.cpu.activations import activation_views, padded_rows, pair_rows
from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation
from ktlite.kernels.cpu.amx_kernels import moe_amx
from ktlite.kernels.cpu.amx_tiles import AMX
from ktlite.kernels.cpu.int8_dots import TILE_ROWS, TILE_TOKENS, gate_up_tiles, row_dot_q8, runs_as_tiles, tile_dot_q8
from ktlite.kernels.cpu.rowdots import DECODE_ONCE_TOKENS, decode_row, f32_dot, row_dot
from ktlite.kernels.cpu.simd import (
    V16, VF, array_args, bf16_scalar_to_f32, bf16_to_f32, c64, is_vec, load_at, splat, vfma, vload, vstore,
)
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

# read by moe.py (CPUMoE imports this module as `kernels`) besides the kernels: whether experts run as VNNI / AMX
# tiles, the AMX tiles' shapes and the INT4 scales' steps
from ktlite.kernels.cpu.amx_kernels import NO_STEPS, fold_steps  # noqa: F401
from ktlite.kernels.cpu.amx_tiles import AMX_BLOCK_ROWS, AMX_MIN_GROUP  # noqa: F401
from ktlite.kernels.cpu.int8_dots import INT_TILES  # noqa: F401

ensure_threadsafe_layer()  # before the first parallel region of the process


def activation_args(activation: ExpertActivation, biases: tuple[np.ndarray, np.ndarray] | None,
                    slot_expert: np.ndarray) -> tuple:
    """moe_rows' `activation`: (plain, alpha, limit, up_offset, gate_up bias [E, 2I], down bias [E, H], slot_expert
    [S]): plain = SiLU(gate) * up without biases (the only activation the VNNI / AMX tiles compute; the row kernels
    then run their unclamped loop as before); the biases fp32 by global expert id (empty: none), slot_expert the
    expert of each slot."""
    gu_b, d_b = (_NO_BIAS, _NO_BIAS) if biases is None else biases
    plain = activation.plain and biases is None
    return (plain, *activation.params(), gu_b, d_b, slot_expert)


_NO_BIAS = np.zeros((0, 0), np.float32)
PLAIN = activation_args(SWIGLU, None, np.zeros(0, np.int64))  # SiLU(gate) * up, no biases: most families' layers


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def moe_rows(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, d_q, d_s, gu_shift, d_shift, q8, scratch, act, out,
             activation):
    """x [T, Kp(hidden)] fp32, zero beyond hidden; slots [M] expert slots into the stacked weights;
    pairs tok_ptr[m]:tok_ptr[m+1] of expert m are tokens tok_idx[p] with weights tok_w[p];
    gu_q/gu_s [E, 2I, ...] (gate rows then up rows), d_q/d_s [E, H, ...], each in its own storage format
    with its own group shift; q8: INT4/INT8 rows dot int8 activations (x and act quantized per 32-block,
    row_dot_q8) instead of fp32 ones; scratch [threads, 2, >= max Kp] fp32 row buffers (one pair per thread:
    allocating them inside prange page-faulted and ran up to 20x slower; `threads` is also the number of parallel
    tasks, each a share of the rows); act [P, Kp(inter)] fp32 scratch, zero beyond I (only act[:, :I] is
    written); out [T, H] fp32, accumulated into; activation: activation_args (the tiles run only the plain one)."""
    plain, alpha, limit, up_offset, gu_b, d_b, slot_expert = activation
    hidden = out.shape[1]
    inter = gu_q.shape[1] // 2
    kp_h = x.shape[1]
    kp_i = act.shape[1]
    n_experts = slots.shape[0]
    xs, xq, xd, xo = activation_views(x, q8)
    threads = scratch.shape[0]
    tiles = np.empty((threads, 2, TILE_ROWS, TILE_TOKENS), np.float32)  # per thread, as scratch
    # each task owns a contiguous share of the rows and walks every expert over it: one long sequential read
    # per matrix (chunks of 16 rows taken across all experts in turn read 16-20 % slower at T=1: each expert
    # switch started a cold stream, and the prefetch past a chunk's end fetched rows another task reads)
    share = (inter + threads - 1) // threads
    for task in prange(threads):
        tid = get_thread_id()
        bg = scratch[tid, 0, :kp_h]
        bu = scratch[tid, 1, :kp_h]
        r_lo, r_hi = task * share, min(inter, (task + 1) * share)
        for m in range(n_experts):
            e = slots[m]
            if plain and runs_as_tiles(q8, gu_q, tok_ptr[m + 1] - tok_ptr[m]):
                gate_up_tiles(gu_q[e], gu_s[e], r_lo, r_hi, xq, xd, tok_idx, tok_ptr[m], tok_ptr[m + 1], gu_shift,
                               tiles[tid], act)
                continue
            # the int8-activation dot is cheaper per token than an fp32 dot of a decoded row: never decode once
            once = not q8 and tok_ptr[m + 1] - tok_ptr[m] >= DECODE_ONCE_TOKENS
            for i in range(r_lo, r_hi):
                gq, gsc, uq, usc = gu_q[e, i], gu_s[e, i], gu_q[e, inter + i], gu_s[e, inter + i]
                if once:
                    decode_row(gq, gsc, bg, gu_shift)
                    decode_row(uq, usc, bu, gu_shift)
                for p in range(tok_ptr[m], tok_ptr[m + 1]):
                    t = tok_idx[p]
                    if once:
                        g = f32_dot(bg, x[t])
                        u = f32_dot(bu, x[t])
                    elif q8:
                        g = row_dot_q8(gq, gsc, x[t], xs[t], xq[t], xd[t], xo[t], gu_shift)
                        u = row_dot_q8(uq, usc, x[t], xs[t], xq[t], xd[t], xo[t], gu_shift)
                    else:
                        g = row_dot(gq, gsc, x[t], xs[t], gu_shift)
                        u = row_dot(uq, usc, x[t], xs[t], gu_shift)
                    if plain:
                        act[p, i] = g / (np.float32(1.0) + np.exp(-g)) * u
                    else:
                        if gu_b.shape[0]:
                            g += gu_b[slot_expert[e], i]
                            u += gu_b[slot_expert[e], inter + i]
                        g = min(g, limit)  # limit: finite, past any activation without one (fastmath: no inf)
                        u = max(min(u, limit), -limit)
                        act[p, i] = g / (np.float32(1.0) + np.exp(-alpha * g)) * (u + up_offset)
    acts, aq, ad, ao = activation_views(act, q8)
    pairs = np.arange(act.shape[0])  # the tiles' row indices into aq / ad
    share = (hidden + threads - 1) // threads
    for task in prange(threads):
        tid = get_thread_id()
        bd = scratch[tid, 0, :kp_i]
        h_lo, h_hi = task * share, min(hidden, (task + 1) * share)
        for m in range(n_experts):
            e = slots[m]
            p_lo, p_hi = tok_ptr[m], tok_ptr[m + 1]
            if plain and runs_as_tiles(q8, d_q, p_hi - p_lo):
                tile = tiles[tid, 0]
                for h0 in range(h_lo, h_hi, TILE_ROWS):
                    for p0 in range(p_lo, p_hi, TILE_TOKENS):
                        tix = pairs[p0:min(p_hi, p0 + TILE_TOKENS)]
                        tile_dot_q8(d_q[e], d_s[e], h0, aq, ad, tix, d_shift, tile)
                        for i in range(min(TILE_ROWS, h_hi - h0)):
                            for j in range(tix.shape[0]):
                                out[tok_idx[p0 + j], h0 + i] += tok_w[p0 + j] * tile[i, j]
                continue
            once = not q8 and p_hi - p_lo >= DECODE_ONCE_TOKENS
            # the share's two halves a row each in turn: two streams from memory, as gate_up's gate and up rows
            # (one stream a thread left V3's INT4 down rows ~5 % slower at T=1)
            half = (h_hi - h_lo + 1) // 2
            for k in range(h_lo, h_lo + half):
                for h in range(k, h_hi, half):
                    dq, dsc = d_q[e, h], d_s[e, h]
                    if once:
                        decode_row(dq, dsc, bd, d_shift)
                    for p in range(tok_ptr[m], tok_ptr[m + 1]):
                        if once:
                            v = f32_dot(bd, act[p])
                        elif q8:
                            v = row_dot_q8(dq, dsc, act[p], acts[p], aq[p], ad[p], ao[p], d_shift)
                        else:
                            v = row_dot(dq, dsc, act[p], acts[p], d_shift)
                        if d_b.shape[0]:
                            v += d_b[slot_expert[e], h]
                        out[tok_idx[p], h] += tok_w[p] * v


@intrinsic
def _bf16_axpy(typingctx, out, w, y):
    """out += w * y for fp32 `out` and bf16-bits `y` (1-D, same length)."""
    if not (is_vec(out, types.float32) and w == types.float32 and is_vec(y, types.uint16)):
        return None
    sig = types.void(out, w, y)

    def codegen(context, builder, sig, args):
        (op, n), (yp, _) = array_args(context, builder, types.void(sig.args[0], sig.args[2]), [args[0], args[2]], 2)
        wv = splat(builder, args[1])
        with cgutils.for_range(builder, builder.lshr(n, c64(4))) as loop:
            k = builder.shl(loop.index, c64(4))
            y16 = bf16_to_f32(builder, vload(builder, yp, k, V16))
            vstore(builder, vfma(builder, wv, y16, vload(builder, op, k, VF)), op, k)
        start = builder.and_(n, c64(~15))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:
            k = builder.add(start, loop.index)
            yk = bf16_scalar_to_f32(builder, load_at(builder, yp, k))
            builder.store(builder.fma(args[1], yk, load_at(builder, op, k)), builder.gep(op, [k], inbounds=True))
        return context.get_dummy_value()

    return sig, codegen


SCATTER_COLS = 512  # columns per parallel task of scatter_add_bf16: a thread's block of `out` stays in L2


@njit(parallel=True, nogil=True, cache=True)
def scatter_add_bf16(ys, tok_idx, tok_w, out):
    """out[tok_idx[p]] += tok_w[p] * ys[p] for every pair p; ys [P, H] bf16 bits, out [T, H] fp32.
    Parallel over column blocks, so a token chosen by several experts never races with itself."""
    hidden = out.shape[1]
    for c in prange((hidden + SCATTER_COLS - 1) // SCATTER_COLS):
        c0 = c * SCATTER_COLS
        c1 = min(hidden, c0 + SCATTER_COLS)
        for p in range(ys.shape[0]):
            _bf16_axpy(out[tok_idx[p], c0:c1], tok_w[p], ys[p, c0:c1])


@njit(nogil=True, cache=True)
def group_pairs(ids, weights, slot_of, pool_of, skip, n_pools):
    """The (token, weight) pairs of ids [T, k] / weights [T, k] grouped by slot, slots ascending within each
    pool, pools in order, tokens ascending within a slot: (slots, tok_ptr, tok_idx, tok_w, pool_ptr), pool p's
    slots being slots[pool_ptr[p]:pool_ptr[p + 1]]; or, if an expert is neither stored nor skipped, that
    expert's id as the last value (else -1). Ids outside [0, E) and experts with skip[e] (when skip is
    not empty) are left out. One compiled pass: the numpy version cost ~15 small array ops per layer."""
    n_slots = pool_of.size
    counts = np.zeros(n_slots, np.int64)
    missing = -1
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0 or e >= slot_of.size or (skip.size > 0 and skip[e]):
                continue
            if slot_of[e] < 0:
                missing = e
            else:
                counts[slot_of[e]] += 1
    order = np.empty(n_slots, np.int64)  # used slots, by pool then slot
    pool_ptr = np.zeros(n_pools + 1, np.int64)
    m = 0
    for p in range(n_pools):
        for slot in range(n_slots):
            if pool_of[slot] == p and counts[slot] > 0:
                order[m] = slot
                m += 1
        pool_ptr[p + 1] = m
    slots = order[:m].copy()
    tok_ptr = np.zeros(m + 1, np.int64)
    start = np.full(n_slots, -1, np.int64)  # next free pair position of each used slot
    for i in range(m):
        tok_ptr[i + 1] = tok_ptr[i] + counts[slots[i]]
        start[slots[i]] = tok_ptr[i]
    tok_idx = np.empty(tok_ptr[m], np.int64)
    tok_w = np.empty(tok_ptr[m], np.float32)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0 or e >= slot_of.size or (skip.size > 0 and skip[e]) or slot_of[e] < 0:
                continue
            at = start[slot_of[e]]
            tok_idx[at], tok_w[at] = t, weights[t, j]
            start[slot_of[e]] = at + 1
    return slots, tok_ptr, tok_idx, tok_w, pool_ptr, missing


@njit(nogil=True, cache=True)
def moe_rows_routed(x, ids, weights, skip, experts):  # pragma: no cover - compiled
    """A few tokens' whole layer in one call (CPUMoE.forward's decode path): the pairs grouped (group_pairs, every
    pool's in one list), x [T, H] padded to kp_h, the experts with amx_from or more pairs through moe_amx and the
    others through moe_rows, as CPUMoE._run_pool splits them -> (out [T, H] fp32, the id of an expert neither stored
    nor skipped, else -1: nothing is computed then). experts = (slot_of, pool_of, n_pools, gu_q, gu_s, d_q, d_s,
    gu_shift, d_shift, kp_h, kp_i, q8, scratch, amx_from, threads, gu_steps, d_steps, work, activation):
    CPUMoE.decode_experts (activation: activation_args; a layer with another than the plain one never reaches AMX);
    work: >= T * k * kp_i fp32, the fused kernels' intermediate rows (reused across calls: a fresh one page-faults,
    ~10 % of a 512-token V3 layer)."""
    (slot_of, pool_of, n_pools, gu_q, gu_s, d_q, d_s, gu_shift, d_shift, kp_h, kp_i, q8, scratch, amx_from, threads,
     gu_steps, d_steps, work, activation) = experts
    slots, tok_ptr, tok_idx, tok_w, _, missing = group_pairs(ids, weights, slot_of, pool_of, skip, n_pools)
    out = np.zeros((x.shape[0], x.shape[1]), np.float32)
    if missing >= 0 or slots.size == 0:
        return out, missing
    xp = padded_rows(x, kp_h)
    tiles = (tok_ptr[1:] - tok_ptr[:-1]) >= amx_from
    inter = gu_q.shape[1] // 2
    if not tiles.all():
        r_slots, r_ptr, r_idx, r_w = _selected_slots(slots, tok_ptr, tok_idx, tok_w, ~tiles)
        act = pair_rows(work, r_idx.shape[0], kp_i, inter)
        moe_rows(xp, r_slots, r_ptr, r_idx, r_w, gu_q, gu_s, d_q, d_s, gu_shift, d_shift, q8, scratch, act, out,
                 activation)
    if tiles.any():
        a_slots, a_ptr, a_idx, a_w = _selected_slots(slots, tok_ptr, tok_idx, tok_w, tiles)
        act = pair_rows(work, a_idx.shape[0], kp_i, inter)
        _moe_amx_on_int_rows(xp, a_slots, a_ptr, a_idx, a_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift,
                             threads, act, out)
    return out, missing


def _moe_amx_on_int_rows(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift,
                         threads, act, out):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("_moe_amx_on_int_rows is only callable from numba-compiled code")


@overload(_moe_amx_on_int_rows, inline="always")
def _moe_amx_on_int_rows_impl(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift,
                              d_shift, threads, act, out):
    """moe_amx for INT4/INT8 rows on a CPU with AMX; nothing elsewhere: other formats never get there
    (CPUMoE._amx_tokens) and moe_amx's tiles do not type for them, and without AMX in the compile target LLVM cannot
    emit the tile instructions at all. A choice at compile time, so moe_rows_routed compiles for every format and CPU."""
    if AMX and gu_q.dtype in (types.uint8, types.int8) and d_q.dtype in (types.uint8, types.int8):
        def on_amx(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift,
                   threads, act, out):
            moe_amx(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift,
                    threads, act, out)
        return on_amx
    return lambda x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift, \
        threads, act, out: None


@njit(nogil=True, cache=True)
def _selected_slots(slots, tok_ptr, tok_idx, tok_w, keep):  # pragma: no cover - compiled
    """The grouped pairs (group_pairs' slots, tok_ptr, tok_idx, tok_w) of the slots i with keep[i]."""
    kept = slots[keep]
    ptr = np.zeros(kept.shape[0] + 1, np.int64)
    idx = np.empty(tok_idx.shape[0], np.int64)
    w = np.empty(tok_idx.shape[0], np.float32)
    j = 0
    for i in range(slots.shape[0]):
        if keep[i]:
            n = tok_ptr[i + 1] - tok_ptr[i]
            idx[ptr[j]:ptr[j] + n] = tok_idx[tok_ptr[i]:tok_ptr[i + 1]]
            w[ptr[j]:ptr[j] + n] = tok_w[tok_ptr[i]:tok_ptr[i + 1]]
            ptr[j + 1] = ptr[j] + n
            j += 1
    return kept, ptr, idx[:ptr[j]], w[:ptr[j]]
