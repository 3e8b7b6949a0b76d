"""All numba code of the CPU experts: row decoding, the fused MoE GEMV kernel, dequantization.

One file on purpose: numba's `cache=True` only checks the timestamp of the file that defines a
cached function, not of the jitted helpers it inlines from other files, so splitting the decoders
from the kernels let a stale cache silently run an old weight layout.

Row primitives: `decode_row(qrow, srow, buf, group_shift)` (group size = 2**group_shift) writes the dequantized row (length Kp)
into `buf`; the format is picked from qrow's dtype at compile time (int8 -> INT8, uint8 -> INT4,
uint16 -> BF16), so every kernel is written once for all methods. Inner loops run a compile-time
CHUNK of 64 bytes over 1-D views indexed from 0: numba then drops its negative-index fix-up and
LLVM vectorizes them fully (a runtime trip count such as the group size, or a 32-byte chunk, ran
3-25x slower). Group sizes are powers of two >= 32, so a chunk needs at most 2 (INT8) or 4 (INT4)
scales, picked by shifts (k >> group_shift: no division in the loop).

`moe_rows` is the fused routed-expert MLP for few tokens (per-expert GEMV, parallel over output
rows). One call runs every selected expert of one layer (one pool's share) in two parallel regions:
  1. gate/up rows: act[p, i] = SiLU(gate_i . x_t) * (up_i . x_t) for each (token t, expert) pair p;
  2. down rows:    out[t, h] += w_p * (down_h . act[p]).
Each weight row is decoded once into an fp32 buffer and then dotted with every token routed to that
expert, so weights stream from RAM once per call however many tokens share an expert. Rows are
split in chunks across threads; a thread owns whole rows of `act`/`out`, so there are no races.
For many tokens this is the "dequantize in the kernel + FMA" GEMM; gemm.py has the oneDNN one.
"""

from __future__ import annotations

import warnings

import numpy as np
import numba
from numba import get_thread_id, njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process
# numba's pedantic SSA check flags the select in the inlined decoders; the code is correct (tested)
warnings.filterwarnings("ignore", message=r"variable '_decode_int", category=numba.NumbaWarning)

CHUNK = 64  # bytes per inner loop; 32 left LLVM's 16-lane x 4 vector body unused


def decode_row(qrow, srow, buf, group_shift):  # pragma: no cover - replaced by the overload in jit code
    raise NotImplementedError("decode_row is only callable from numba-compiled code")


def _decode_int8(qrow, srow, buf, group_shift):
    for c in range(qrow.shape[0] // CHUNK):
        k0 = CHUNK * c
        sa = srow[k0 >> group_shift]
        sb = srow[(k0 + CHUNK // 2) >> group_shift]  # differs from sa only for G = 32
        wc = qrow[k0:k0 + CHUNK]
        bc = buf[k0:k0 + CHUNK]
        for j in range(CHUNK):
            bc[j] = np.float32(wc[j]) * (sa if j < CHUNK // 2 else sb)


def _decode_int4(qrow, srow, buf, group_shift):
    # 64 bytes hold a 128-weight chunk: byte j -> k = j (low nibble) and k = j + 64 (high nibble)
    for c in range(qrow.shape[0] // CHUNK):
        k0 = 2 * CHUNK * c
        sa = srow[k0 >> group_shift]
        sb = srow[(k0 + CHUNK // 2) >> group_shift]
        sc = srow[(k0 + CHUNK) >> group_shift]
        sd = srow[(k0 + 3 * CHUNK // 2) >> group_shift]
        wc = qrow[c * CHUNK:(c + 1) * CHUNK]
        lo = buf[k0:k0 + CHUNK]
        hi = buf[k0 + CHUNK:k0 + 2 * CHUNK]
        for j in range(CHUNK):
            b = np.int32(wc[j])
            lo[j] = np.float32((b & 15) - 8) * (sa if j < CHUNK // 2 else sb)
            hi[j] = np.float32((b >> 4) - 8) * (sc if j < CHUNK // 2 else sd)


def _decode_bf16(qrow, srow, buf, group_shift):
    bits = buf.view(np.uint32)
    for j in range(qrow.shape[0]):
        bits[j] = np.uint32(qrow[j]) << np.uint32(16)


@overload(decode_row, inline="always", jit_options={"fastmath": True})
def _decode_row_impl(qrow, srow, buf, group_shift):
    dtype = qrow.dtype
    if dtype == types.int8:
        return _decode_int8
    if dtype == types.uint8:
        return _decode_int4
    if dtype == types.uint16:
        return _decode_bf16
    return None


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def dot(a, b):
    """sum(a * b) over a's length (b may be longer)."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


ROWS_PER_CHUNK = 16  # rows a thread takes per expert before moving on: long sequential reads


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def moe_rows(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, d_q, d_s, group_shift, kp_hidden, kp_inter,
             scratch, act, out):
    """x [T, H] fp32; slots [M] expert slots into the stacked weights; pairs tok_ptr[m]:tok_ptr[m+1]
    of expert m are tokens tok_idx[p] with weights tok_w[p]; gu_q/gu_s [E, 2I, ...] (gate rows then
    up rows), d_q/d_s [E, H, ...]; scratch [threads, 2, >= max(kp)] row buffers (one pair per
    thread: allocating them inside prange page-faulted and ran up to 20x slower); act [P, I] scratch;
    out [T, H] fp32, accumulated into."""
    hidden = x.shape[1]
    inter = gu_q.shape[1] // 2
    n_experts = slots.shape[0]
    for c in prange((inter + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK):
        tid = get_thread_id()
        bg = scratch[tid, 0, :kp_hidden]
        bu = scratch[tid, 1, :kp_hidden]
        gv = bg[:hidden]
        uv = bu[:hidden]
        for m in range(n_experts):
            e = slots[m]
            for i in range(c * ROWS_PER_CHUNK, min(inter, (c + 1) * ROWS_PER_CHUNK)):
                decode_row(gu_q[e, i], gu_s[e, i], bg, group_shift)
                decode_row(gu_q[e, inter + i], gu_s[e, inter + i], bu, group_shift)
                for p in range(tok_ptr[m], tok_ptr[m + 1]):
                    xr = x[tok_idx[p]]
                    g = dot(gv, xr)
                    act[p, i] = g / (np.float32(1.0) + np.exp(-g)) * dot(uv, xr)
    for c in prange((hidden + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK):
        bd = scratch[get_thread_id(), 0, :kp_inter]
        dv = bd[:inter]
        for m in range(n_experts):
            e = slots[m]
            for h in range(c * ROWS_PER_CHUNK, min(hidden, (c + 1) * ROWS_PER_CHUNK)):
                decode_row(d_q[e, h], d_s[e, h], bd, group_shift)
                for p in range(tok_ptr[m], tok_ptr[m + 1]):
                    out[tok_idx[p], h] += tok_w[p] * dot(dv, act[p])


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def dequant_rows_f32(q, s, group_shift, kp, scratch, out):
    """q/s [N, ...] one stored matrix -> out fp32 [N, K] (K <= kp); scratch as in moe_rows."""
    k = out.shape[1]
    for n in prange(q.shape[0]):
        buf = scratch[get_thread_id(), 0, :kp]
        decode_row(q[n], s[n], buf, group_shift)
        out[n, :] = buf[:k]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def dequant_rows_bf16(q, s, group_shift, kp, scratch, out):
    """q/s [N, ...] one stored matrix -> out uint16 bf16 bits [N, K] (K <= kp), round to nearest even."""
    k = out.shape[1]
    for n in prange(q.shape[0]):
        buf = scratch[get_thread_id(), 0, :kp]
        decode_row(q[n], s[n], buf, group_shift)
        bits = buf.view(np.uint32)
        row = out[n]
        for j in range(k):
            b = bits[j]
            row[j] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
