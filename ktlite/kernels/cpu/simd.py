"""LLVM vector primitives the CPU kernels' numba intrinsics are written with (every kernel module imports these).

Row primitives are numba intrinsics that emit LLVM vector IR directly (16 fp32 lanes = one zmm register on
AVX-512; LLVM splits them on narrower machines). Written as plain numba loops, LLVM fully unrolled the 64-byte
chunk loop and then either left it scalar (`vcvtsi2ss` per weight, int64 nibble arithmetic because numba widens
integer ops to intp) or vectorized the *outer* loop with gathers; every format then ran at ~10 G weights/s on 2
cores, bound by decoding, not memory.

Here: the IR types (`I8`..`F32`, 16-lane vectors `V8`..`VF`, the 32/64-byte vectors of the integer dots), vector
load / store / splat / FMA / horizontal sum, the software prefetch every row loop issues PREFETCH_BYTES ahead of
the bytes it reads (a thread walks two row streams, gate and up, while it decodes, and the hardware prefetcher
alone left INT4 decode at ~60 % of memory bandwidth), bf16 <-> fp32 conversions and the vector SiLU.

The kernels live in several files by concern (rowdots, int8_dots, amx_tiles, bf16_blocks, activations, linear_kernels,
amx_kernels, moe_kernels, device_blocks); numba's cache is keyed on a hash of all of them (numba_cache.py), so a
change here recompiles every cached kernel that inlines it.
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ktlite.kernels.cpu.target import configure_numba

CHUNK = 64  # bytes per chunk: 64 INT8 or 128 INT4 weights (quant.py's INT4 nibble layout)
XS_BLOCK = 32  # weights per entry of xs (the smallest group size)

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
LANES = 16
V8, V16, V32, VF = (ir.VectorType(t, LANES) for t in (I8, I16, I32, F32))


def c64(v):
    return ir.Constant(I64, v)


def cvec(vty, val):
    return ir.Constant(vty, [val] * vty.count)


def splat(builder, val, vty=VF):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def vfma(builder, a, b, c):
    """a * b + c for fp32 vectors of any lane count."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fma.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def vload(builder, base, off, vty):
    return builder.load(builder.bitcast(builder.gep(base, [off], inbounds=True), vty.as_pointer()), align=1)


def vstore(builder, val, base, off):
    builder.store(val, builder.bitcast(builder.gep(base, [off], inbounds=True), val.type.as_pointer()), align=1)


def load_at(builder, base, off):
    return builder.load(builder.gep(base, [off], inbounds=True))


# software prefetch distance: with 2 streams per thread (gate and up rows) and FMA work between loads the
# hardware prefetcher alone kept INT4 decode at ~60 % of memory bandwidth; 4 KiB ahead reaches ~100 %
PREFETCH_BYTES = 4096


def prefetch_ahead(builder, base, off, ahead=PREFETCH_BYTES):
    """Hint that the bytes at base[off + ahead] are needed soon (llvm.prefetch: read, keep in all caches)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")
    ptr = builder.bitcast(builder.gep(base, [builder.add(off, c64(ahead))]), I8.as_pointer())
    builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def reduce_lanes(builder, v, combine):
    """combine(a, b) over a float vector's lanes, as a halving tree (the lower half with the upper half)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
        v = combine(lo, hi)
    return builder.extract_element(v, ir.Constant(I32, 0))


def hsum(builder, v):
    """Sum of a float vector's lanes."""
    return reduce_lanes(builder, v, builder.fadd)


def array_args(context, builder, sig, args, n):
    """(data pointer, length) of the first n (1-D, C-contiguous) array arguments."""
    out = []
    for ty, val in zip(sig.args[:n], args[:n]):
        a = context.make_array(ty)(context, builder, val)
        out.append((a.data, builder.extract_value(a.shape, 0)))
    return out


def is_vec(ty, dtype=None):
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and (dtype is None or ty.dtype == dtype)


def load_nibbles(builder, qp, off):
    """16 bytes at qp[off] -> (low nibbles, high nibbles) as int32 vectors."""
    z = builder.zext(vload(builder, qp, off, V8), V32)
    return builder.and_(z, cvec(V32, 15)), builder.lshr(z, cvec(V32, 4))


# byte / word / dword vectors of the integer dots (int8_dots.py, amx_tiles.py)
B32, W16, D8, F8 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8), ir.VectorType(F32, 8)
F2 = ir.VectorType(F32, 2)
B64, W32 = ir.VectorType(I8, 64), ir.VectorType(I16, 32)


def llvm_call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


_EXP_TAYLOR = [1.0 / math.factorial(i) for i in range(7)]  # e^r = sum r^i / i!, |r| <= ln 2 / 2: error ~1e-7
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 in two parts (Cody-Waite): n ln2_hi exact for |n| <= 126


@intrinsic
def silu_mul(typingctx, g, u):
    """g = SiLU(g) * u = g u / (1 + exp(-g)) elementwise, 16 lanes at a time (g, u C-contiguous fp32 of the same
    size, a multiple of 16). numba's np.exp is one libm call per value (no SVML): here exp(-g) = 2^n e^r with n =
    round(-g log2 e), r = -g - n ln 2 (in two parts, so r keeps fp32 precision), e^r a degree-6 Taylor polynomial,
    g clamped to +-87 (exp(-g) in fp32's normal range; the product is ~0 or g u there anyway)."""
    if not all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in (g, u)):
        return None
    sig = types.void(g, u)

    def codegen(context, builder, sig, args):
        ga, ua = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args))
        with cgutils.for_range(builder, builder.lshr(ga.nitems, c64(4))) as loop:
            k = builder.shl(loop.index, c64(4))
            gv = vload(builder, ga.data, k, VF)
            neg = builder.fneg(llvm_call(builder, "llvm.minnum.v16f32", VF, [
                llvm_call(builder, "llvm.maxnum.v16f32", VF, [gv, cvec(VF, -87.0)]), cvec(VF, 87.0)]))
            n = llvm_call(builder, "llvm.rint.v16f32", VF, [builder.fmul(neg, cvec(VF, math.log2(math.e)))])
            r = vfma(builder, n, cvec(VF, -_LN2_LO), vfma(builder, n, cvec(VF, -_LN2_HI), neg))
            poly = cvec(VF, _EXP_TAYLOR[-1])
            for c in reversed(_EXP_TAYLOR[:-1]):
                poly = vfma(builder, poly, r, cvec(VF, c))
            two_n = builder.bitcast(builder.shl(builder.add(builder.fptosi(n, V32), cvec(V32, 127)),
                                                cvec(V32, 23)), VF)
            denom = vfma(builder, poly, two_n, cvec(VF, 1.0))
            vstore(builder, builder.fdiv(builder.fmul(gv, vload(builder, ua.data, k, VF)), denom), ga.data, k)
        return context.get_dummy_value()

    return sig, codegen


def byte_ptr(builder, ptr):
    return builder.bitcast(ptr, I8.as_pointer())


def bf16_to_f32(builder, bits16):
    return builder.bitcast(builder.shl(builder.zext(bits16, V32), cvec(V32, 16)), VF)


def bf16_scalar_to_f32(builder, bits16):
    return builder.bitcast(builder.shl(builder.zext(bits16, I32), ir.Constant(I32, 16)), F32)


class _BFloat(ir.Type):
    """LLVM's bfloat (llvmlite has no class for it): fptrunc to it lets LLVM pick vcvtneps2bf16 on CPUs
    with AVX512-BF16."""

    def _to_string(self):
        return "bfloat"


_BF16 = _BFloat()  # one instance: llvmlite compares these types by identity
_VBF, _VBF_PAIRS = ir.VectorType(_BF16, LANES), ir.VectorType(_BF16, 2 * LANES)


def _native_bf16() -> bool:
    """Whether the compile target converts to bf16 in hardware. Elsewhere LLVM lowers fptrunc to bfloat
    as a call to compiler-rt's __truncsfbf2, which the JIT cannot resolve (the process aborts), so the
    rounding is spelled out in integer ops instead."""
    return configure_numba().enabled("avx512bf16")


def round_bf16(builder, v, flush_denormals: bool = False):
    """fp32 vector -> bf16 bits, round to nearest even (as torch's .to(bfloat16) for finite values). With
    flush_denormals, CPUs with AVX512-BF16 convert in one instruction (vcvtneps2bf16), which treats denormal inputs
    as zero: fine for attention's queries and probabilities, not for dequantized weights that must equal torch's
    bit for bit (an MX scale of 2^-127 makes denormals)."""
    if flush_denormals and _native_bf16():
        return builder.bitcast(builder.fptrunc(v, _VBF), V16)
    bits = builder.bitcast(v, V32)
    odd = builder.and_(builder.lshr(bits, cvec(V32, 16)), cvec(V32, 1))  # ties go to the even neighbour
    rounded = builder.add(bits, builder.add(odd, cvec(V32, 0x7FFF)))
    return builder.trunc(builder.lshr(rounded, cvec(V32, 16)), V16)


def dpbf16ps(builder, acc, a_words, b_words):
    """acc (16 fp32) + a[2i] b[2i] + a[2i + 1] b[2i + 1] in lane i, a_words / b_words 16 x i32 holding two bf16 each
    (vdpbf16ps: the compile target must have AVX512-BF16)."""
    return llvm_call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", VF,
                     [acc, builder.bitcast(a_words, _VBF_PAIRS), builder.bitcast(b_words, _VBF_PAIRS)])


@intrinsic
def to_bf16_bits(typingctx, src, dst, n):
    """dst[:n] = the bf16 bits of src[:n] rounded to nearest even (round_bf16, denormals possibly flushed to zero),
    16 lanes at a time: n a multiple of 16, src fp32 and dst uint16, both 1-D C-contiguous."""
    if not (f32_vector(src) and is_vec(dst, types.uint16)):
        return None
    sig = types.void(src, dst, types.int64)

    def codegen(context, builder, sig, args):
        sp, dp = (context.make_array(t)(context, builder, v).data for t, v in zip(sig.args[:2], args[:2]))
        with cgutils.for_range(builder, builder.lshr(args[2], c64(4))) as loop:
            k = builder.shl(loop.index, c64(4))
            vstore(builder, round_bf16(builder, vload(builder, sp, k, VF), flush_denormals=True), dp, k)
        return context.get_dummy_value()

    return sig, codegen


def f32_vector(ty) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype == types.float32


@intrinsic
def vm_acc(typingctx, a, m, acc, n, width):
    """acc[i][:width] += sum_{j < n} a[i][j] * m[j, :width] for each i of the tuples a and acc (K 1-D fp32 arrays
    each; m 2-D C-contiguous fp32 with at least width columns). 64 output lanes at a time (64 / K per row) stay in
    registers while j runs, and each vector of m loaded serves all K rows: with K = 2 a block's tile is streamed
    from L2 half as often as row by row (one load per FMA was bound by L2 bandwidth)."""
    ok = (isinstance(a, types.UniTuple) and isinstance(acc, types.UniTuple) and a.count == acc.count
          and a.count in (1, 2, 4) and f32_vector(a.dtype) and f32_vector(acc.dtype)
          and isinstance(m, types.Array) and m.ndim == 2 and m.layout == "C" and m.dtype == types.float32)
    if not ok:
        return None
    sig = types.void(a, m, acc, types.int64, types.int64)
    k_rows = a.count

    def codegen(context, builder, sig, args):
        def data(tup_ty, tup, i):
            return context.make_array(tup_ty.dtype)(context, builder, builder.extract_value(tup, i)).data

        aps = [data(sig.args[0], args[0], i) for i in range(k_rows)]
        ops = [data(sig.args[2], args[2], i) for i in range(k_rows)]
        marr = context.make_array(sig.args[1])(context, builder, args[1])
        mp, stride = marr.data, builder.extract_value(marr.shape, 1)
        n, width = args[3], args[4]

        def lanes(c0, vectors):  # acc[i][c0 : c0 + 16 * vectors] for every i, over every j
            offs = [builder.add(c0, c64(16 * v)) for v in range(vectors)]
            accs = [[cgutils.alloca_once_value(builder, vload(builder, op, off, VF)) for off in offs] for op in ops]
            with cgutils.for_range(builder, n) as loop:
                coefs = [splat(builder, load_at(builder, ap, loop.index)) for ap in aps]
                row = builder.mul(loop.index, stride)
                for v, off in enumerate(offs):
                    m_v = vload(builder, mp, builder.add(row, off), VF)
                    for coef, slots in zip(coefs, accs):
                        builder.store(vfma(builder, m_v, coef, builder.load(slots[v])), slots[v])
            for op, slots in zip(ops, accs):
                for off, slot in zip(offs, slots):
                    vstore(builder, builder.load(slot), op, off)

        per = 4 // k_rows  # vectors per row in the wide pass
        step = 16 * per
        with cgutils.for_range(builder, builder.udiv(width, c64(step))) as loop:
            lanes(builder.mul(loop.index, c64(step)), per)
        wide = builder.mul(builder.udiv(width, c64(step)), c64(step))
        with cgutils.for_range(builder, builder.lshr(builder.sub(width, wide), c64(4))) as loop:
            lanes(builder.add(wide, builder.shl(loop.index, c64(4))), 1)
        tail = builder.and_(width, c64(~15))
        with cgutils.for_range(builder, builder.sub(width, tail)) as outer:
            d = builder.add(tail, outer.index)
            for ap, op in zip(aps, ops):
                total = cgutils.alloca_once_value(builder, load_at(builder, op, d))
                with cgutils.for_range(builder, n) as loop:
                    m_jd = load_at(builder, mp, builder.add(builder.mul(loop.index, stride), d))
                    builder.store(builder.fma(load_at(builder, ap, loop.index), m_jd, builder.load(total)), total)
                builder.store(builder.load(total), builder.gep(op, [d], inbounds=True))
        return context.get_dummy_value()

    return sig, codegen


def vmax(builder, a, b):
    suffix = f"v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "f32"
    return llvm_call(builder, f"llvm.maxnum.{suffix}", a.type, [a, b])


@intrinsic
def row_max(typingctx, x, lo, hi, init):
    """max(init, x[lo:hi]) for a 1-D fp32 array, 16 lanes at a time (a plain numba max loop stays scalar: ~0.7
    cycles a value, as much as the exp that follows it)."""
    if not (f32_vector(x) and isinstance(init, types.Float)):
        return None
    sig = types.float32(x, types.int64, types.int64, types.float32)

    def codegen(context, builder, sig, args):
        xp = context.make_array(sig.args[0])(context, builder, args[0]).data
        lo, hi, init = args[1], args[2], args[3]
        chunks = builder.sdiv(builder.sub(hi, lo), c64(LANES))
        acc = cgutils.alloca_once_value(builder, splat(builder, init))
        with cgutils.for_range(builder, chunks) as loop:
            off = builder.add(lo, builder.mul(loop.index, c64(LANES)))
            builder.store(vmax(builder, builder.load(acc), vload(builder, xp, off, VF)), acc)
        top = cgutils.alloca_once_value(builder, vmax_lanes(builder, builder.load(acc)))
        tail = builder.add(lo, builder.mul(chunks, c64(LANES)))
        with cgutils.for_range(builder, builder.sub(hi, tail)) as loop:
            builder.store(vmax(builder, builder.load(top), load_at(builder, xp, builder.add(tail, loop.index))), top)
        return builder.load(top)

    return sig, codegen


@intrinsic
def exp2_sum(typingctx, x, lo, hi, top):
    """x[lo:hi] <- 2 ** (x[lo:hi] - top), returning their sum, 16 lanes at a time ((hi - lo) a multiple of 16, x
    <= top): 2^n from the exponent bits, n = rint(t), and 2^(t - n) = e^r, r = (t - n) ln 2, by silu_mul's Taylor
    polynomial (relative error ~1e-7). t is clamped at -127, whose exponent bits are zero: a value at the kernels'
    "no score" -1e30 gives exactly 0 (numba's np.exp2 is a libm call per value)."""
    if not (f32_vector(x) and isinstance(top, types.Float)):
        return None
    sig = types.float32(x, types.int64, types.int64, types.float32)

    def codegen(context, builder, sig, args):
        xp = context.make_array(sig.args[0])(context, builder, args[0]).data
        lo, hi, top = args[1], args[2], splat(builder, args[3])
        total = cgutils.alloca_once_value(builder, cvec(VF, 0.0))
        with cgutils.for_range(builder, builder.sdiv(builder.sub(hi, lo), c64(LANES))) as loop:
            off = builder.add(lo, builder.mul(loop.index, c64(LANES)))
            val = exp2_vec(builder, builder.fsub(vload(builder, xp, off, VF), top))
            vstore(builder, val, xp, off)
            builder.store(builder.fadd(builder.load(total), val), total)
        return hsum(builder, builder.load(total))

    return sig, codegen


def exp2_vec(builder, t):
    """2 ** t for an fp32 vector t <= 0 (exp2_sum's method: exactly 0 from t <= -127 on)."""
    t = llvm_call(builder, "llvm.maxnum.v16f32", VF, [t, cvec(VF, -127.0)])
    n = llvm_call(builder, "llvm.rint.v16f32", VF, [t])
    r = builder.fmul(builder.fsub(t, n), cvec(VF, math.log(2.0)))
    poly = cvec(VF, _EXP_TAYLOR[-1])
    for c in reversed(_EXP_TAYLOR[:-1]):
        poly = vfma(builder, poly, r, cvec(VF, c))
    two_n = builder.bitcast(builder.shl(builder.add(builder.fptosi(n, V32), cvec(V32, 127)), cvec(V32, 23)), VF)
    return builder.fmul(poly, two_n)


# 2^r on |r| <= 1/2, a degree-5 fit of the relative error (at most 8e-8, fp32 rounding aside)
_EXP2_FIT = [1.0000000710296983, 0.6931469491610631, 0.24022121753561645, 0.0555074261600255, 0.00967545974551767,
             0.0013266970386325856]


def exp2_fast(builder, t):
    """2 ** t for an fp32 vector t <= 0. With AVX-512, vscalefps applies 2^n (n = rint(t)) to a degree-5 fit of
    2^(t - n): 8 vector ops against exp2_vec's 14, no clamp (it flushes to 0 itself); elsewhere exp2_vec."""
    if not configure_numba().enabled("avx512f"):
        return exp2_vec(builder, t)
    n = llvm_call(builder, "llvm.rint.v16f32", VF, [t])
    r = builder.fsub(t, n)
    poly = cvec(VF, _EXP2_FIT[-1])
    for c in reversed(_EXP2_FIT[:-1]):
        poly = vfma(builder, poly, r, cvec(VF, c))
    return llvm_call(builder, "llvm.x86.avx512.mask.scalef.ps.512", VF,
                     [poly, n, cvec(VF, 0.0), ir.Constant(I16, -1), ir.Constant(I32, 4)])


def vmax_lanes(builder, v):
    """The largest lane of an fp32 vector."""
    return reduce_lanes(builder, v, lambda a, b: vmax(builder, a, b))
