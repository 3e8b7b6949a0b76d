"""Numba quantizer for the INT4/INT8 group-wise formats (quant.py): parallel over rows.

Same results as the torch formulation it replaced (tests/test_fast_quantizer.py keeps that one as the
reference): INT8 scale = max|w| / 127; INT4 tries the scales s = peak / -d for d in INT4_DIVISORS
(peak: the first value of largest magnitude) and keeps the first with the least squared error, codes
round half to even (`np.rint`, like `torch.round`) and clamp. Scales and final codes use true
division, bit for bit as torch does.

Where the time goes (one Zen 3 core, 7 candidates): the candidate errors are one pass over the group
with 7 accumulators (vectorized with `reassoc`), 8 fp32 lanes per op. Two things kept it fast:
- candidate codes use x * (1 / s) rather than x / s (a division per weight per candidate was half
  the time); the two differ only when x / s sits within an ulp of a half-integer, where both codes
  have the same error, so the choice of scale does not change; `1 / s` is computed outside the
  reassociating function, or LLVM folds the multiply back into a division;
- the errors accumulate in fp32 in vector order (torch sums in its own order): the choice differs
  only when two candidates' errors tie to ~1e-7, which the tests did not meet in millions of groups.
INT4 scales are then rounded to whole multiples of one step per row (_row_multiples), and the codes taken with the
rounded scales.
Source rows are bf16 bits (uint16, the checkpoints' dtype: no fp32 copy) or fp32.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import get_thread_id, njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()

INT4_DIVISORS = (7.0, 7.5, 8.0, 8.5, 9.0, 9.5, 10.0)  # candidate scales: peak / -d
INT4_MULTIPLES = 15  # a row's group scales are m x its step, |m| <= 15: |code x m| <= 120 fits int8
_NEG_DIVISORS = np.array([-d for d in INT4_DIVISORS] + [-INT4_DIVISORS[-1]], np.float32)  # padded to 8 lanes
_REASSOC = {"reassoc", "nsz"}


def _to_f32(src, k, g):  # pragma: no cover - replaced by the overload in jit code
    """g[:k] = src[:k] as fp32 (bf16 bits widen by a shift), g[k:] = 0 (the padding)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_to_f32, inline="always")
def _to_f32_impl(src, k, g):
    if src.dtype == types.uint16:
        def widen(src, k, g):
            bits = g.view(np.uint32)
            for j in range(k):
                bits[j] = np.uint32(src[j]) << np.uint32(16)
            g[k:] = np.float32(0.0)
        return widen

    def copy(src, k, g):
        for j in range(k):
            g[j] = np.float32(src[j])
        g[k:] = np.float32(0.0)
    return copy


@njit(nogil=True, cache=True, fastmath=_REASSOC)
def _amax(x):
    m = np.float32(0.0)
    for j in range(x.shape[0]):
        m = max(m, abs(x[j]))
    return m


@njit(nogil=True, cache=True, fastmath=_REASSOC)
def _peak(x):
    """The first value of largest magnitude (as torch's argmax of |x| picks it): from the group's max and
    min (two vectorized reductions), scanning only when +m and -m both occur."""
    hi = x[0]
    lo = x[0]
    for j in range(1, x.shape[0]):
        hi = max(hi, x[j])
        lo = min(lo, x[j])
    if hi != -lo:
        return hi if hi > -lo else lo
    for j in range(x.shape[0]):
        if abs(x[j]) == hi:
            return x[j]
    return hi


@njit(nogil=True, cache=True)
def _codes(x, scale, lo, hi, out):
    safe = scale if scale != 0 else np.float32(1.0)
    for j in range(x.shape[0]):
        out[j] = np.int8(min(max(np.rint(x[j] / safe), lo), hi))


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz", "contract"})
def _int4_errors(x, sr, out):
    """out[i] = sum_j (clamp(rint(x_j * sr[8 + i])) * sr[i] - x_j)^2 for the 7 candidates in one pass."""
    lo, hi = np.float32(-8.0), np.float32(7.0)
    s0, s1, s2, s3, s4, s5, s6 = sr[0], sr[1], sr[2], sr[3], sr[4], sr[5], sr[6]
    r0, r1, r2, r3, r4, r5, r6 = sr[8], sr[9], sr[10], sr[11], sr[12], sr[13], sr[14]
    e0 = e1 = e2 = e3 = e4 = e5 = e6 = np.float32(0.0)
    for j in range(x.shape[0]):
        xj = x[j]
        d = min(max(np.rint(xj * r0), lo), hi) * s0 - xj
        e0 += d * d
        d = min(max(np.rint(xj * r1), lo), hi) * s1 - xj
        e1 += d * d
        d = min(max(np.rint(xj * r2), lo), hi) * s2 - xj
        e2 += d * d
        d = min(max(np.rint(xj * r3), lo), hi) * s3 - xj
        e3 += d * d
        d = min(max(np.rint(xj * r4), lo), hi) * s4 - xj
        e4 += d * d
        d = min(max(np.rint(xj * r5), lo), hi) * s5 - xj
        e5 += d * d
        d = min(max(np.rint(xj * r6), lo), hi) * s6 - xj
        e6 += d * d
    out[0], out[1], out[2], out[3], out[4], out[5], out[6] = e0, e1, e2, e3, e4, e5, e6


@njit(nogil=True, cache=True)
def _int4_scale(x, neg_divisors, sr, errs):
    """The chosen INT4 scale of one group (0 for an all-zero group)."""
    peak = _peak(x)
    if peak == 0:
        return np.float32(0.0)
    inv = np.float32(1.0) / peak
    for i in range(8):
        sr[i] = peak / neg_divisors[i]
        sr[8 + i] = neg_divisors[i] * inv  # 1 / sr[i] up to an ulp: only for the candidates' codes
    _int4_errors(x, sr, errs)
    best = 0
    for i in range(1, len(INT4_DIVISORS)):
        if errs[i] < errs[best]:
            best = i
    return sr[best]


@njit(nogil=True, cache=True)
def _row_multiples(s, bits):
    """Each group scale of one row rounded to a whole multiple m of the row's step = max |s| / INT4_MULTIPLES
    (|m| in 1..INT4_MULTIPLES, zero scales stay zero): code x m then fits a signed byte, so the AMX tiles multiply
    the stored weights as (code x m) and sum a whole row without a per-group rescale (amx_kernels.fold_steps). The
    step keeps 20 significant bits, so step x m is exact in fp32 and max |s| / INT4_MULTIPLES gives it back.
    bits: a 1-element uint32 scratch."""
    top = _amax(s)
    if top == 0:
        return
    f = bits.view(np.float32)
    f[0] = top / np.float32(INT4_MULTIPLES)
    bits[0] = (bits[0] + np.uint32(8)) & np.uint32(0xFFFFFFF0)  # round to 20 significant bits
    step = f[0]
    for b in range(s.shape[0]):
        if s[b] != 0:
            m = min(max(np.rint(abs(s[b]) / step), np.float32(1.0)), np.float32(INT4_MULTIPLES))
            s[b] = step * m if s[b] > 0 else -step * m


@njit(parallel=True, nogil=True, cache=True)
def quantize_int4_rows(w, neg_divisors, group, scratch, codes, q, s):
    """w [R, K] bf16 bits or fp32 -> q uint8 [R, Kp / 2] (quant.py's nibble layout), s fp32 [R, Kp / G].
    scratch [threads, >= Kp] fp32 and codes [threads, >= Kp] int8 are per-thread row buffers."""
    k = w.shape[1]
    kp = q.shape[1] * 2
    for r in prange(w.shape[0]):
        tid = get_thread_id()
        g = scratch[tid, :kp]
        c = codes[tid, :kp]
        sr = np.empty(16, np.float32)
        errs = np.empty(8, np.float32)
        _to_f32(w[r], k, g)
        for b in range(kp // group):
            s[r, b] = _int4_scale(g[b * group:(b + 1) * group], neg_divisors, sr, errs)
        _row_multiples(s[r], sr[:1].view(np.uint32))
        for b in range(kp // group):
            x = g[b * group:(b + 1) * group]
            _codes(x, s[r, b], np.float32(-8.0), np.float32(7.0), c[b * group:(b + 1) * group])
        qr = q[r]
        for ch in range(kp // 128):  # byte j of a 128-weight chunk: k = j (low nibble), k = j + 64 (high)
            lo = c[ch * 128:ch * 128 + 64]
            hi = c[ch * 128 + 64:ch * 128 + 128]
            out = qr[ch * 64:ch * 64 + 64]
            for j in range(64):
                out[j] = np.uint8((lo[j] + 8) | ((hi[j] + 8) << 4))


@njit(parallel=True, nogil=True, cache=True)
def quantize_int8_rows(w, group, scratch, q, s):
    """w [R, K] bf16 bits or fp32 -> q int8 [R, Kp], s fp32 [R, Kp / G]; scratch [threads, >= Kp] fp32."""
    k = w.shape[1]
    kp = q.shape[1]
    for r in prange(w.shape[0]):
        g = scratch[get_thread_id(), :kp]
        _to_f32(w[r], k, g)
        for b in range(kp // group):
            x = g[b * group:(b + 1) * group]
            scale = _amax(x) / np.float32(127.0)
            s[r, b] = scale
            _codes(x, scale, np.float32(-127.0), np.float32(127.0), q[r, b * group:(b + 1) * group])


def quantize_rows(w: np.ndarray, method: str, group: int, q: np.ndarray, s: np.ndarray) -> None:
    """Quantize rows `w` [R, K] (bf16 bits as uint16, or fp32) into `q`/`s` [R, ...] (C-contiguous) in place."""
    kp = q.shape[1] * (2 if method == "INT4" else 1)
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, kp), np.float32)
    if method == "INT4":
        codes = np.empty((numba.config.NUMBA_NUM_THREADS, kp), np.int8)
        quantize_int4_rows(w, _NEG_DIVISORS, group, scratch, codes, q, s)
    else:
        quantize_int8_rows(w, group, scratch, q, s)
