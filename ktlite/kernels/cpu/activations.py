"""The kernels' activations: int8 quantizers (per 32 values for the row dots and VNNI tiles, per weight group for
the AMX tiles, packed in AMX's VNNI layout), fp32 block sums (INT4's offset term), and the padded input rows and
reused intermediate rows the MoE and linear kernels read and write.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ktlite.kernels.cpu.simd import (
    F32, V32, V8, VF, XS_BLOCK, array_args, c64, cvec, is_vec, llvm_call, splat, vload, vstore,
)
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process


@intrinsic
def abs_max(typingctx, x):
    """max |x| of a C-contiguous fp32 vector whose length is a multiple of 16, 16 lanes at a time (numba's loop
    of max(m, abs(v)) stays scalar: ~1 ns a value, most of the activation quantizer's time)."""
    if not is_vec(x, types.float32):
        return None
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        (xp, n), = array_args(context, builder, sig, args, 1)
        m = cgutils.alloca_once_value(builder, cvec(VF, 0.0))
        with cgutils.for_range(builder, builder.lshr(n, c64(4))) as loop:
            v = llvm_call(builder, "llvm.fabs.v16f32", VF, [vload(builder, xp, builder.shl(loop.index, c64(4)), VF)])
            builder.store(llvm_call(builder, "llvm.maxnum.v16f32", VF, [builder.load(m), v]), m)
        return llvm_call(builder, "llvm.vector.reduce.fmax.v16f32", F32, [builder.load(m)])

    return sig, codegen


@intrinsic
def scale_to_codes(typingctx, x, inv, q):
    """q = int8(rint(x * inv)) elementwise (x C-contiguous fp32, q int8 of the same length, a multiple of 16; |x *
    inv| <= 127.5), 16 lanes at a time: the activation quantizer's loop stays scalar in numba (~1 ns a value)."""
    if not (is_vec(x, types.float32) and inv == types.float32 and is_vec(q, types.int8)):
        return None
    sig = types.void(x, inv, q)

    def codegen(context, builder, sig, args):
        (xp, n), = array_args(context, builder, sig, args, 1)
        qp = context.make_array(sig.args[2])(context, builder, args[2]).data
        scale = splat(builder, args[1])
        with cgutils.for_range(builder, builder.lshr(n, c64(4))) as loop:
            k = builder.shl(loop.index, c64(4))
            v = llvm_call(builder, "llvm.rint.v16f32", VF, [builder.fmul(vload(builder, xp, k, VF), scale)])
            vstore(builder, builder.trunc(builder.fptosi(v, V32), V8), qp, k)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def quantize_group(x, q):
    """q = round(x * 127 / max |x|) (int8, to nearest even; zeros where x is all zeros) for one group x (fp32, a
    multiple of 16 values); returns its scale max |x| / 127."""
    amax = abs_max(x)
    scale_to_codes(x, np.float32(127.0) / amax if amax > 0 else np.float32(0.0), q)
    return amax / np.float32(127.0)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def quantize_groups(x, gsize):
    """x [R, Kp] fp32 -> (xq [R, Kp] int8, xd [R, Kp / gsize] fp32): each group of gsize values (a multiple of 16
    dividing Kp) quantized (quantize_group)."""
    xq = np.empty(x.shape, np.int8)
    xd = np.empty((x.shape[0], x.shape[1] // gsize), np.float32)
    for r in prange(x.shape[0]):
        xr, qr = x[r], xq[r]
        for g in range(xd.shape[1]):
            xd[r, g] = quantize_group(xr[g * gsize:(g + 1) * gsize], qr[g * gsize:(g + 1) * gsize])
    return xq, xd


@njit(nogil=True, cache=True)
def pack_amx_tile(xq, xd, rows, xb, xdb):
    """Activation tile of the quantized rows xq[rows[c]] / xd[rows[c]] (quantize_groups; at most 16 rows): xb [Kp /
    4, 64] int8 in VNNI layout (xb[k // 4, 4 c + k % 4] = token c's value k: word k // 4 of token c is the tile's
    int32 [k // 4, c]), xdb [groups, 16] their scales; tokens past len(rows) are zeros."""
    words, q_words = xb.view(np.int32), xq.view(np.int32)
    n = rows.shape[0]
    for kk in range(words.shape[0]):
        for c in range(n):
            words[kk, c] = q_words[rows[c], kk]
        words[kk, n:] = 0
    for g in range(xdb.shape[0]):
        for c in range(n):
            xdb[g, c] = xd[rows[c], g]
        xdb[g, n:] = 0.0


@njit(nogil=True, cache=True, inline="always")
def block_sums(x, xs):
    """xs[b] = sum of x[32 b : 32 b + 32] (x's length is a multiple of 32)."""
    for b in range(xs.shape[0]):
        xb = x[XS_BLOCK * b:XS_BLOCK * (b + 1)]
        s = np.float32(0.0)
        for j in range(XS_BLOCK):
            s += xb[j]
        xs[b] = s


@njit(nogil=True, cache=True, inline="always")
def quantize_activations(x, xq, xd, xo):
    """x [Kp] fp32 (Kp a multiple of 32) -> int8 activations per 32-block b: xd[b] = max |x| / 127,
    xq = round(x * 127 / max |x|) (to nearest even), xo[b] = 8 xd[b] sum_b xq (INT4's offset term)."""
    for b in range(xd.shape[0]):
        qb = xq[XS_BLOCK * b:XS_BLOCK * (b + 1)]
        xd[b] = quantize_group(x[XS_BLOCK * b:XS_BLOCK * (b + 1)], qb)
        total = 0
        for j in range(XS_BLOCK):
            total += np.int32(qb[j])
        xo[b] = np.float32(8.0) * xd[b] * np.float32(total)


@njit(nogil=True, cache=True)
def activation_views(x, q8):
    """What the row dots read besides x [R, Kp]: its block sums (fp32 path) or its int8 activations
    (q8: xq, xd, xo of quantize_activations); the arrays of the path not taken are empty."""
    blocks = x.shape[1] // XS_BLOCK
    rows, qrows = (0, x.shape[0]) if q8 else (x.shape[0], 0)
    xs = np.empty((rows, blocks), np.float32)
    xq = np.empty((qrows, x.shape[1]), np.int8)
    xd = np.empty((qrows, blocks), np.float32)
    xo = np.empty((qrows, blocks), np.float32)
    for r in range(rows):
        block_sums(x[r], xs[r])
    for r in range(qrows):
        quantize_activations(x[r], xq[r], xd[r], xo[r])
    return xs, xq, xd, xo


@njit(nogil=True, cache=True)
def padded_rows(x, kp):  # pragma: no cover - compiled
    """x [T, K] with zero columns up to kp (the row kernels read whole padded rows): x itself where K == kp (a
    fresh copy of 512 V3 rows is 15 MB of page faults)."""
    if x.shape[1] == kp:
        return x
    xp = np.zeros((x.shape[0], kp), np.float32)
    xp[:, :x.shape[1]] = x
    return xp


@njit(nogil=True, cache=True)
def pair_rows(work, pairs, kp, inter):  # pragma: no cover - compiled
    """The fused kernels' intermediate [pairs, kp] fp32 rows over a reused flat buffer `work` (a fresh array per call
    page-faults): the kernels write columns < inter of every row, and read the padding after them as zeros."""
    act = work[:pairs * kp].reshape((pairs, kp))
    act[:, inter:] = 0.0
    return act
