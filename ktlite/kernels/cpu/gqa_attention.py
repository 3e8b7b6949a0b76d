"""GQA decode and extend attention compiled for a CPU device, flash-style (the twins reference.gqa_extend_torch and
gqa_decode_torch are the spec; registered as their "cpu" implementation in ktlite/kernels/attention.py).

The twin builds a [tokens x context] score matrix per request, masks it and softmaxes it: at an 18k-token prompt
that is gigabytes per layer. Here a work item is (query block, kv head, key run): the block's queries of all the
kv head's query heads (group x block rows, so each K/V tile is read once for the whole group) walk the keys in
tiles of `key_tile` positions, gathered from the pool through req_to_token and decoded to fp32 (K transposed, so the
scores are contiguous multiply-adds), and keep per row a running max, exp-sum and weighted V sum (online softmax,
scores in log2 units, exp2 by a polynomial LLVM vectorizes: numba has no vector exp here). A row stops at its own
causal limit (prefix + its index + 1), computed per row: no mask. Items run in parallel (prange); where there are
fewer (query block x kv head) items than threads (decode at small batch, a short extend after a long prefix) each
item's keys are split into runs merged afterwards (flash-decoding, as attention.py does for MLA).

Pool layouts read in place: fp32 and bf16 K/V buffers [slots, Hkv, D] (bf16 as its uint16 bits, widened in the
kernel), and packed FP8 head rows [slots, Hkv, D + 4] uint8 (kv_fp8.head_rows: e4m3 codes through a 256-entry
table, times the row's fp32 scale, the same product the twin forms). Queries fp32, bf16 or fp16 (read as fp32);
the result is in q's dtype. Dot products are fp32 FMAs on every CPU (the score tile is a [D x key_tile] axpy, not a
bf16 dot product; AVX-512 machines get wider vectors from the same code).

Bound (tests/test_cpu_gqa_attention.py): against the twin, |out - twin| <= 2e-5 * (1 + |twin|) on fp32 outputs
(fp32 accumulation in another order, the exp2 polynomial's ~2e-7 relative error); with bf16/fp16 queries the
outputs are rounded to q's dtype, so the bound is one ulp of that dtype on top.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu import device_blocks
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer
from ktlite.kernels.triton.kv_fp8 import is_packed

ensure_threadsafe_layer()  # before the first parallel region of the process

ROWS_PER_ITEM = 64  # group x query block: rows sharing each decoded K/V tile
TILE_FLOATS = 8192  # key_tile x head_dim of a decoded tile (32 KiB: an L1/L2 resident K tile)
_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_NO_SCALES = np.zeros((1, 1), np.float32)

_F = np.float32
LOG2E, LN2, NEG = _F(1.4426950408889634), _F(0.6931471805599453), _F(-1e30)
_ONE, _HALF, _MIN_EXP = _F(1.0), _F(0.5), _F(-126.0)
_C2, _C3, _C4, _C5, _C6 = (_F(1 / 2), _F(1 / 6), _F(1 / 24), _F(1 / 120), _F(1 / 720))


@njit(cache=True, fastmath=True)
def exp2_row(x, n, bits):  # pragma: no cover - compiled
    """x[:n] <- 2 ** x[:n] (inputs <= 0; below -126 gives ~1e-38, not 0): 2^k from the exponent bits, 2^f for
    f in [-1/2, 1/2] by e^(f ln 2)'s Taylor series to degree 6 (relative error < 2e-7). bits: int32 scratch."""
    for j in range(n):
        t = max(x[j], _MIN_EXP)
        k = np.floor(t + _HALF)
        f = (t - k) * LN2
        x[j] = _ONE + f * (_ONE + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * _C6)))))
        bits[j] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for j in range(n):
        x[j] *= scale[j]


def decode_row(buf, scales, lut, slot, head, out, out_bits):
    """out (fp32 [width]) <- kv head `head` of pool slot `slot`, decoded from the buffer's layout."""


@overload(decode_row, jit_options={"fastmath": True})
def _decode_row(buf, scales, lut, slot, head, out, out_bits):
    if buf.dtype == types.uint8:  # packed FP8 head rows: e4m3 code x the row's scale
        def fp8(buf, scales, lut, slot, head, out, out_bits):
            src, scale = buf[slot, head], scales[slot, head]
            for d in range(out.shape[0]):
                out[d] = lut[src[d]] * scale
        return fp8
    if buf.dtype == types.uint16:  # bf16 bits: the high half of an fp32
        def bf16(buf, scales, lut, slot, head, out, out_bits):
            src = buf[slot, head]
            for d in range(out.shape[0]):
                out_bits[d] = np.uint32(src[d]) << np.uint32(16)
        return bf16

    def fp32(buf, scales, lut, slot, head, out, out_bits):
        src = buf[slot, head]
        for d in range(out.shape[0]):
            out[d] = src[d]
    return fp32


@njit(cache=True, fastmath=True)
def gather_tile(buf, scales, lut, slots, k0, nk, head, tile, transposed, row, row_bits):  # pragma: no cover
    """tile <- positions k0..k0+nk of a request (slots = its req_to_token row), kv head `head`, as fp32:
    tile[d, j] if transposed else tile[j, d]. row/row_bits: one row's fp32 scratch and its uint32 view."""
    width = row.shape[0]
    for j in range(nk):
        decode_row(buf, scales, lut, slots[k0 + j], head, row, row_bits)
        if transposed:
            for d in range(width):
                tile[d, j] = row[d]
        else:
            for d in range(width):
                tile[j, d] = row[d]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def gqa_attention(q, k, k_scales, v, v_scales, lut, req_to_token, rows, prefix, lens, starts, blk_req, blk_q0,
                  block, key_tile, runs, sm_scale, out, part_o, part_ml):  # pragma: no cover - compiled
    """out [N, Hq, Dv] fp32 <- causal GQA of q [N, Hq, D] (fp32) over the pool (layouts in the module docstring).
    Request b's queries are rows starts[b].. of q, at positions prefix[b]..prefix[b] + lens[b] - 1 of its
    req_to_token row rows[b]; query blocks (blk_req, blk_q0) of up to `block` queries; `runs` key runs per item,
    whose partial sums go through part_o [runs, N, Hq, Dv] and part_ml [runs, N, Hq, 2] (max, exp-sum) when > 1."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, dv = k.shape[1], out.shape[2]
    group = heads // kv_heads
    scale2 = np.float32(sm_scale) * LOG2E  # scores in log2 units: exp2 below
    per_block = kv_heads * runs
    for item in prange(blk_req.shape[0] * per_block):
        blk, h, run = item // per_block, (item % per_block) // runs, item % runs
        b, q0 = blk_req[blk], blk_q0[blk]
        nq = min(block, lens[b] - q0)
        n_rows, first = nq * group, starts[b] + q0
        qt = np.empty((n_rows, dim), np.float32)  # row r = query r // group, query head h * group + r % group
        for r in range(n_rows):
            for d in range(dim):
                qt[r, d] = q[first + r // group, h * group + r % group, d] * scale2
        o = np.zeros((n_rows, dv), np.float32)
        m = np.full(n_rows, NEG, np.float32)
        s_sum = np.zeros(n_rows, np.float32)
        kt = np.empty((dim, key_tile), np.float32)
        vt = np.empty((key_tile, dv), np.float32)
        p = np.empty(key_tile, np.float32)
        bits = np.empty(key_tile, np.int32)
        row = np.empty(max(dim, dv), np.float32)
        row_bits = row.view(np.uint32)
        seen = prefix[b] + q0 + nq  # positions the block's last query sees
        span = (seen + runs - 1) // runs
        lo, hi = run * span, min(seen, (run + 1) * span)
        slots = req_to_token[rows[b]]
        for k0 in range(lo, hi, key_tile):
            nk = min(key_tile, hi - k0)
            gather_tile(k, k_scales, lut, slots, k0, nk, h, kt, True, row[:dim], row_bits[:dim])
            gather_tile(v, v_scales, lut, slots, k0, nk, h, vt, False, row[:dv], row_bits[:dv])
            for r in range(n_rows):
                nv = min(nk, prefix[b] + q0 + r // group + 1 - k0)  # this row's causal limit inside the tile
                if nv <= 0:
                    continue
                for j in range(nv):
                    p[j] = 0.0
                for d in range(dim):
                    qd, kd = qt[r, d], kt[d]
                    for j in range(nv):
                        p[j] += qd * kd[j]
                top = m[r]
                for j in range(nv):
                    top = max(top, p[j])
                for j in range(nv):
                    p[j] -= top
                exp2_row(p, nv, bits)
                alpha = np.exp2(m[r] - top)
                total = np.float32(0.0)
                for j in range(nv):
                    total += p[j]
                s_sum[r] = s_sum[r] * alpha + total
                m[r] = top
                orow = o[r]
                for e in range(dv):
                    orow[e] *= alpha
                for j in range(nv):
                    pj, vj = p[j], vt[j]
                    for e in range(dv):
                        orow[e] += pj * vj[e]
        for r in range(n_rows):
            t, hq = first + r // group, h * group + r % group
            if runs == 1:  # every row saw at least its own position: s_sum > 0
                inv = np.float32(1.0) / s_sum[r]
                for e in range(dv):
                    out[t, hq, e] = o[r, e] * inv
            else:
                part_ml[run, t, hq, 0], part_ml[run, t, hq, 1] = m[r], s_sum[r]
                for e in range(dv):
                    part_o[run, t, hq, e] = o[r, e]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def merge_runs(part_o, part_ml, out):  # pragma: no cover - compiled
    """out[t, h] <- the runs' partial sums rescaled to their common max, over their total exp-sum."""
    runs, n_tok, heads, dv = part_o.shape
    for item in prange(n_tok * heads):
        t, h = item // heads, item % heads
        top = NEG
        for r in range(runs):
            if part_ml[r, t, h, 1] > 0.0:
                top = max(top, part_ml[r, t, h, 0])
        total = np.float32(0.0)
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


def accepts(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, *_: object) -> bool:
    """Whether gqa_extend / gqa_decode take these inputs (else the twin does): CPU, fp32/bf16/fp16 queries, K and V
    both fp32, both bf16 or both packed FP8 rows, unit stride along the head dim."""
    return (q.device.type == "cpu" and q.dtype in _Q_DTYPES and k_buffer.dtype == v_buffer.dtype
            and k_buffer.dtype in _POOL_DTYPES and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1)


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
               runs: int | None = None) -> torch.Tensor:
    """reference.gqa_extend_torch's signature and result ([N, Hq, Dv] in q's dtype); `runs` overrides the key
    runs per item (tests)."""
    k, k_scales, dim = _pool(k_buffer)
    v, v_scales, dv = _pool(v_buffer)
    out = np.zeros((q.shape[0], q.shape[1], dv), np.float32)
    if q.shape[0] == 0:
        return torch.from_numpy(out).to(q.dtype)
    prefix, lens = prefix_lens.to(torch.int64).numpy(), extend_lens.to(torch.int64).numpy()
    group = q.shape[1] // k.shape[1]
    block = max(1, ROWS_PER_ITEM // group)
    blk_req, blk_q0 = query_blocks(prefix, lens, block)
    if runs is None:
        longest = int((prefix + np.minimum(lens, block)).max()) if lens.size else 1
        runs = device_blocks.decode_splits(blk_req.shape[0] * k.shape[1], longest, numba.config.NUMBA_NUM_THREADS)
    many = runs > 1
    part_o = np.empty((runs if many else 0, *out.shape), np.float32)
    part_ml = np.empty((runs if many else 0, q.shape[0], q.shape[1], 2), np.float32)
    starts = np.cumsum(lens) - lens
    gqa_attention(q.float().contiguous().numpy(), k, k_scales, v, v_scales, _E4M3, req_to_token.numpy(),
                  req_pool_indices.to(torch.int64).numpy(), prefix, lens, starts, blk_req, blk_q0, block,
                  max(64, min(256, TILE_FLOATS // max(dim, dv))), runs, sm_scale, out, part_o, part_ml)
    if many:
        merge_runs(part_o, part_ml, out)
    return torch.from_numpy(out).to(q.dtype)


def gqa_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
               runs: int | None = None) -> torch.Tensor:
    """reference.gqa_decode_torch's signature and result: the extend kernel with one query per request."""
    return gqa_extend(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens - 1, torch.ones_like(seq_lens),
                      sm_scale, runs)
