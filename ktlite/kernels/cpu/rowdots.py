"""Row dots and row decoders of every storage format, on fp32 activations.

Group size = 2**group_shift (32, 64 or 128), each row a whole number of 64-byte chunks (quant.py pads):

- `row_dot(qrow, srow, x, xs, group_shift)` = sum_k w[k] x[k] straight from the stored row, for
  x of length >= Kp (zero padded). Per 16 weights: widen bytes to int32 (`vpmovzxbd`/`vpmovsxbd`),
  nibble and/shift (INT4), `vcvtdq2ps`, FMA with x; the products of a 32-weight block are summed in
  a vector, multiplied by the block's scale and added to a vector accumulator (one horizontal sum per
  row). INT4's -8 offset is folded out: sum (q - 8) s x = sum s (q x) - 8 sum_b s_b xs[b], with
  xs[b] = sum of x over 32-block b (computed once per token). BF16: shift into fp32 bits + FMA.
- FP8 (E4M3 records, fp8.py, fp32 scales) and MXFP8 (E4M3 records with uint8 e8m0 scales, mx.py) decode each
  e4m3 byte to the fp16 of value * 2^-8 by three integer ops and widen it with `vcvtph2ps` (exact, 2.5x the
  integer decode it replaced on AMD Zen 3), the 2^8 going into the block's scale; MXFP4 (E2M1X2 records: two
  e2m1 codes a byte, even k in the low nibble) splits 16 bytes into nibbles, interleaves them back into k order
  (two byte shuffles) and looks up each code's value as bf16 bytes (`pshufb`), its 32 weights scaled as one block;
  the power of two that makes the codes whole goes into the block's scale. GGUF blocks (Q4_K, Q5_K,
  Q6_K, Q8_0 records, gguf_quants.py) are walked run by run (`_gguf_runs`: 16 codes, their scale and min), the
  scales unpacked in scalar IR per sub-block.
- `decode_row(qrow, srow, out, group_shift)` writes the dequantized row (length Kp) into `out`:
  fp32, or bf16 bits (uint16, round to nearest even via LLVM's fptrunc to bfloat) when `out` is
  uint16 (the prefill path).

The same rows on int8 activations: int8_dots.py.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ktlite.kernels.cpu.fp8 import E4M3
from ktlite.kernels.cpu.gguf_quants import BLOCKS
from ktlite.kernels.cpu.mx import E2M1_VALUES, E2M1X2
from ktlite.kernels.cpu.simd import (
    F32, I8, I16, I32, LANES, V16, V32, V8, VF, array_args, bf16_scalar_to_f32, bf16_to_f32, byte_ptr, c64, cvec, hsum,
    is_vec, load_at, load_nibbles, prefetch_ahead, round_bf16, splat, vfma, vload, vstore,
)

_T_E4M3 = numba.from_dtype(E4M3)
_T_E2M1X2 = numba.from_dtype(E2M1X2)
_T_GGUF = {numba.from_dtype(dtype): kind for kind, (dtype, _) in BLOCKS.items()}  # numba record type -> GGML type


@intrinsic
def _int4_row_dot(typingctx, q, s, x, xs, gs):
    if not (is_vec(q, types.uint8) and is_vec(s, types.float32) and is_vec(x, types.float32)
            and is_vec(xs, types.float32)):
        return None
    sig = types.float32(q, s, x, xs, types.int64)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _), (xsp, _) = array_args(context, builder, sig, args, 4)
        gs = args[4]
        acc_lo = cgutils.alloca_once_value(builder, cvec(VF, 0.0))
        acc_hi = cgutils.alloca_once_value(builder, cvec(VF, 0.0))
        off = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        with cgutils.for_range(builder, builder.lshr(nb, c64(6))) as loop:
            c = loop.index
            k0 = builder.shl(c, c64(7))  # chunk c: bytes 64c.., weights 128c..
            b0 = builder.shl(c, c64(6))
            prefetch_ahead(builder, qp, b0)
            sc = [load_at(builder, sp, builder.lshr(builder.add(k0, c64(32 * i)), gs)) for i in range(4)]
            o = builder.load(off)
            for i in range(4):
                o = builder.fma(sc[i], load_at(builder, xsp, builder.add(builder.shl(c, c64(2)), c64(i))), o)
            builder.store(o, off)
            lo, hi = zip(*(load_nibbles(builder, qp, builder.add(b0, c64(16 * p))) for p in range(4)))
            part = []
            for vals, base in ((lo, 0), (hi, 64)):  # 32-weight blocks base+0 and base+32
                f = [builder.sitofp(v, VF) for v in vals]
                xv = [vload(builder, xp, builder.add(k0, c64(base + 16 * p)), VF) for p in range(4)]
                part.append(vfma(builder, f[1], xv[1], builder.fmul(f[0], xv[0])))
                part.append(vfma(builder, f[3], xv[3], builder.fmul(f[2], xv[2])))
            a = vfma(builder, part[0], splat(builder, sc[0]), builder.load(acc_lo))
            builder.store(vfma(builder, part[1], splat(builder, sc[1]), a), acc_lo)
            a = vfma(builder, part[2], splat(builder, sc[2]), builder.load(acc_hi))
            builder.store(vfma(builder, part[3], splat(builder, sc[3]), a), acc_hi)
        tot = hsum(builder, builder.fadd(builder.load(acc_lo), builder.load(acc_hi)))
        return builder.fsub(tot, builder.fmul(ir.Constant(F32, 8.0), builder.load(off)))

    return sig, codegen


@intrinsic
def _int8_row_dot(typingctx, q, s, x, gs):
    if not (is_vec(q, types.int8) and is_vec(s, types.float32) and is_vec(x, types.float32)):
        return None
    sig = types.float32(q, s, x, types.int64)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _) = array_args(context, builder, sig, args, 3)
        gs = args[3]
        accs = [cgutils.alloca_once_value(builder, cvec(VF, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, builder.lshr(nb, c64(6))) as loop:
            k0 = builder.shl(loop.index, c64(6))
            prefetch_ahead(builder, qp, k0)
            f = [builder.sitofp(vload(builder, qp, builder.add(k0, c64(16 * p)), V8), VF) for p in range(4)]
            xv = [vload(builder, xp, builder.add(k0, c64(16 * p)), VF) for p in range(4)]
            for h, acc in enumerate(accs):
                part = vfma(builder, f[2 * h + 1], xv[2 * h + 1], builder.fmul(f[2 * h], xv[2 * h]))
                scale = load_at(builder, sp, builder.lshr(builder.add(k0, c64(32 * h)), gs))
                builder.store(vfma(builder, part, splat(builder, scale), builder.load(acc)), acc)
        return hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

    return sig, codegen


def _group_scales(s):
    """Whether `s` is a scale row the float-coded formats take: fp32 (FP8) or e8m0 bytes (MX)."""
    return is_vec(s, types.float32) or is_vec(s, types.uint8)


# The float codes decode to value * 2^CODE_SHIFT, exact in fp32, and the group's scale takes 2^-CODE_SHIFT back.
# e2m1: 2 * value is a whole number (0, 1, 2, 3, 4, 6, 8 or 12); e4m3: value * 2^-8 is an fp16 (_e4m3_lanes).
# The fp32 results are normal numbers: no subnormal operand slows a multiply, and no constant multiply is left
# for fastmath to reassociate with the scale.
# e4m3's 2^8 in an e8m0 scale limits MXFP8's scale bytes to mx.MXFP8_MAX_SCALE_BYTE (larger ones are refused at load).
CODE_SHIFT = {"e2m1": 1, "e4m3": -8}


def _ci(v):
    return ir.Constant(I32, v)


def _scale_at(builder, sp, idx, shift=0):
    """Scale `idx` of a row as fp32 times 2^-shift: an fp32 scale times that power of two (exact: FP8 block scales
    are far from fp32's range ends); an e8m0 byte s (uint8 rows) as 2^(s - 127 - shift) from its bits (normal, or
    subnormal from 2^-127 down: exact for every byte up to 254 - shift with shift <= 22)."""
    raw = load_at(builder, sp, idx)
    if raw.type == F32:
        return builder.fmul(raw, ir.Constant(F32, 2.0**-shift)) if shift else raw
    p = builder.sub(builder.zext(raw, I32), _ci(127 + shift))  # the power of two
    normal = builder.shl(builder.add(p, _ci(127)), _ci(23))
    tiny = builder.shl(_ci(1), builder.add(p, _ci(149)))
    return builder.bitcast(builder.select(builder.icmp_signed(">=", p, _ci(-126)), normal, tiny), F32)


_HALVES = ir.VectorType(ir.HalfType(), LANES)


def _e4m3_lanes(builder, qp, k):
    """16 e4m3 codes at qp[k] -> value * 2^-8 as fp32, exactly. The byte's sign moved to bit 15 and its exponent
    and mantissa to bits 13..7 is the fp16 of value * 2^-8 (e4m3's 4-bit exponent in fp16's 5-bit field: bias 15
    for 7; e4m3 subnormals land on fp16 subnormals), which `vcvtph2ps` (F16C, every AVX2 CPU) widens exactly:
    four integer ops per 16 codes (byte to the top of a word, arithmetic shift by 1, clear bit 14). NaN
    (0x7f / 0xff) reads as +-480: checkpoints hold none."""
    top = builder.shl(builder.zext(vload(builder, qp, k, V8), V16), cvec(V16, 8))
    bits = builder.and_(builder.ashr(top, cvec(V16, 1)), cvec(V16, -0x4080))  # 0xBF80 as int16
    return builder.fpext(builder.bitcast(bits, _HALVES), VF)


@intrinsic
def _fp8_row_dot(typingctx, q, s, x, gs):
    if not (is_vec(q, _T_E4M3) and _group_scales(s) and is_vec(x, types.float32)):
        return None
    sig = types.float32(q, s, x, types.int64)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _) = array_args(context, builder, sig, args, 3)
        qp = byte_ptr(builder, qp)
        gs = args[3]
        accs = [cgutils.alloca_once_value(builder, cvec(VF, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, builder.lshr(nb, c64(6))) as loop:
            k0 = builder.shl(loop.index, c64(6))
            prefetch_ahead(builder, qp, k0)
            f = [_e4m3_lanes(builder, qp, builder.add(k0, c64(16 * p))) for p in range(4)]
            xv = [vload(builder, xp, builder.add(k0, c64(16 * p)), VF) for p in range(4)]
            for h, acc in enumerate(accs):  # 32-weight halves: a group is at least 32 wide
                part = vfma(builder, f[2 * h + 1], xv[2 * h + 1], builder.fmul(f[2 * h], xv[2 * h]))
                scale = _scale_at(builder, sp, builder.lshr(builder.add(k0, c64(32 * h)), gs), CODE_SHIFT["e4m3"])
                builder.store(vfma(builder, part, splat(builder, scale), builder.load(acc)), acc)
        return hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

    return sig, codegen


_SHUFFLE_MASK = ir.VectorType(I32, LANES)


def _bf16_bytes(v: float) -> tuple[int, int]:
    """(low, high) byte of bf16 v (exact for these values), as signed i8 constants."""
    bits = int(np.float32(v).view(np.uint32)) >> 16
    return tuple(b - 256 if b > 127 else b for b in (bits & 0xFF, bits >> 8))


# twice each e2m1 value (0, +-1, 2, 3, 4, 6, 8, 12: whole numbers, exact bf16) as bf16 bytes, by code
_E2M1_LO, _E2M1_HI = zip(*(_bf16_bytes(2 * v) for v in E2M1_VALUES))


def _pshufb(builder, table, idx):
    """16 table bytes looked up by idx (<16 x i8>, 0..15): SSSE3 `pshufb` (every x86-64 CPU ktlite runs on has it)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8, [V8, V8]), "llvm.x86.ssse3.pshuf.b.128")
    return builder.call(fn, [ir.Constant(V8, list(table)), idx])


def _e2m1_block(builder, qp, b):
    """The 32 weights (times 2) of the 16 bytes at qp[b] in k order, as two fp32 vectors (weights 0-15, 16-31): byte j
    holds k = 2j (low nibble) and 2j + 1 (high), so low and high nibbles interleave back (punpck{l,h}bw); each code
    then looks up the two bytes of its value's bf16 pattern (two `pshufb`), which become the upper half of the fp32
    lanes: exact, signed zero included, ~4x fewer instructions than decoding sign, exponent and mantissa."""
    raw = vload(builder, qp, b, V8)
    lo = builder.and_(raw, cvec(V8, 15))
    hi = builder.lshr(raw, cvec(V8, 4))
    zeros = ir.Constant(ir.VectorType(I8, 2 * LANES), [0] * (2 * LANES))
    fp32_bytes = ir.Constant(ir.VectorType(I32, 4 * LANES), [v for j in range(LANES) for v in (32, 32, j, LANES + j)])
    halves = []
    for first in (0, LANES // 2):
        mask = [v for j in range(first, first + LANES // 2) for v in (j, j + LANES)]
        codes = builder.shuffle_vector(lo, hi, ir.Constant(_SHUFFLE_MASK, mask))
        both = builder.shuffle_vector(_pshufb(builder, _E2M1_LO, codes), _pshufb(builder, _E2M1_HI, codes),
                                      ir.Constant(ir.VectorType(I32, 2 * LANES), list(range(2 * LANES))))
        halves.append(builder.bitcast(builder.shuffle_vector(both, zeros, fp32_bytes), VF))
    return halves


@intrinsic
def _mxfp4_row_dot(typingctx, q, s, x):
    if not (is_vec(q, _T_E2M1X2) and is_vec(s, types.uint8) and is_vec(x, types.float32)):
        return None
    sig = types.float32(q, s, x)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _) = array_args(context, builder, sig, args, 3)
        qp = byte_ptr(builder, qp)
        accs = [cgutils.alloca_once_value(builder, cvec(VF, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, builder.lshr(nb, c64(5))) as loop:  # 32 bytes, 64 weights a step
            b0 = builder.shl(loop.index, c64(5))
            prefetch_ahead(builder, qp, b0)
            for h, acc in enumerate(accs):  # one 32-weight block (its own scale) each
                b = builder.add(b0, c64(16 * h))
                k = builder.shl(b, c64(1))
                f = _e2m1_block(builder, qp, b)
                part = vfma(builder, f[1], vload(builder, xp, builder.add(k, c64(16)), VF),
                            builder.fmul(f[0], vload(builder, xp, k, VF)))
                scale = _scale_at(builder, sp, builder.lshr(b, c64(4)), CODE_SHIFT["e2m1"])
                builder.store(vfma(builder, part, splat(builder, scale), builder.load(acc)), acc)
        return hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

    return sig, codegen


@intrinsic
def _bf16_row_dot(typingctx, q, x):
    if not (is_vec(q, types.uint16) and is_vec(x, types.float32)):
        return None
    sig = types.float32(q, x)

    def codegen(context, builder, sig, args):
        (qp, n), (xp, _) = array_args(context, builder, sig, args, 2)
        accs = [cgutils.alloca_once_value(builder, cvec(VF, 0.0)) for _ in range(4)]
        with cgutils.for_range(builder, builder.lshr(n, c64(6))) as loop:  # 64 weights per step
            k0 = builder.shl(loop.index, c64(6))
            prefetch_ahead(builder, qp, k0)  # uint16 elements: twice the distance in bytes
            for p, acc in enumerate(accs):
                k = builder.add(k0, c64(16 * p))
                w = bf16_to_f32(builder, vload(builder, qp, k, V16))
                builder.store(vfma(builder, w, vload(builder, xp, k, VF), builder.load(acc)), acc)
        tot = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                           builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        res = cgutils.alloca_once_value(builder, hsum(builder, tot))
        start = builder.and_(n, c64(~63))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:  # BF16 rows are not padded
            k = builder.add(start, loop.index)
            w = bf16_scalar_to_f32(builder, load_at(builder, qp, k))
            builder.store(builder.fma(w, load_at(builder, xp, k), builder.load(res)), res)
        return builder.load(res)

    return sig, codegen


@intrinsic
def f32_dot(typingctx, a, b):
    if not (is_vec(a, types.float32) and is_vec(b, types.float32)):
        return None
    sig = types.float32(a, b)

    def codegen(context, builder, sig, args):
        (ap, n), (bp, _) = array_args(context, builder, sig, args, 2)
        accs = [cgutils.alloca_once_value(builder, cvec(VF, 0.0)) for _ in range(4)]
        with cgutils.for_range(builder, builder.lshr(n, c64(6))) as loop:  # 64 per step
            k0 = builder.shl(loop.index, c64(6))
            for p, acc in enumerate(accs):
                k = builder.add(k0, c64(16 * p))
                builder.store(vfma(builder, vload(builder, ap, k, VF), vload(builder, bp, k, VF),
                                    builder.load(acc)), acc)
        tot = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                           builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        res = cgutils.alloca_once_value(builder, hsum(builder, tot))
        start = builder.and_(n, c64(~63))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:
            k = builder.add(start, loop.index)
            builder.store(builder.fma(load_at(builder, ap, k), load_at(builder, bp, k), builder.load(res)), res)
        return builder.load(res)

    return sig, codegen


def _decoder(qdtype):
    """decode_row for one byte-coded format: INT4 (uint8 nibbles), INT8 (int8), FP8 / MXFP8 (E4M3 records with fp32
    or e8m0 scales) or MXFP4 (E2M1X2 records, e8m0 scales)."""
    float_codes = qdtype in (_T_E4M3, _T_E2M1X2)

    def typer(typingctx, q, s, out, gs):
        scales_ok = _group_scales(s) if float_codes else is_vec(s, types.float32)
        if not (is_vec(q, qdtype) and scales_ok and (is_vec(out, types.float32) or is_vec(out, types.uint16))):
            return None
        bf16 = out.dtype == types.uint16
        shift = CODE_SHIFT["e2m1"] if qdtype == _T_E2M1X2 else CODE_SHIFT["e4m3"] if qdtype == _T_E4M3 else 0
        sig = types.void(q, s, out, types.int64)

        def codegen(context, builder, sig, args):
            (qp, nb), (sp, _), (op, _) = array_args(context, builder, sig, args, 3)
            qp = byte_ptr(builder, qp)
            gs = args[3]

            def put(v, k):  # v: fp32 lanes of weights k..k+15 before their group's scale
                v = builder.fmul(v, splat(builder, _scale_at(builder, sp, builder.lshr(k, gs), shift)))
                vstore(builder, round_bf16(builder, v) if bf16 else v, op, k)

            step = 5 if qdtype == _T_E2M1X2 else 6  # log2 of the bytes a step: MXFP4 rows are 32-byte multiples
            with cgutils.for_range(builder, builder.lshr(nb, c64(step))) as loop:
                b0 = builder.shl(loop.index, c64(step))
                prefetch_ahead(builder, qp, b0)
                if qdtype == types.uint8:
                    k0 = builder.shl(loop.index, c64(7))
                    for p in range(4):
                        lo, hi = load_nibbles(builder, qp, builder.add(b0, c64(16 * p)))
                        put(builder.sitofp(builder.sub(lo, cvec(V32, 8)), VF), builder.add(k0, c64(16 * p)))
                        put(builder.sitofp(builder.sub(hi, cvec(V32, 8)), VF), builder.add(k0, c64(64 + 16 * p)))
                elif qdtype == _T_E2M1X2:
                    for p in range(2):  # 16 bytes, 32 weights in k order each
                        b = builder.add(b0, c64(16 * p))
                        for i, v in enumerate(_e2m1_block(builder, qp, b)):
                            put(v, builder.add(builder.shl(b, c64(1)), c64(16 * i)))
                else:
                    for p in range(4):
                        k = builder.add(b0, c64(16 * p))
                        if qdtype == types.int8:
                            put(builder.sitofp(builder.sext(vload(builder, qp, k, V8), V32), VF), k)
                        else:
                            put(_e4m3_lanes(builder, qp, k), k)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


_decode_int4 = _decoder(types.uint8)
_decode_int8 = _decoder(types.int8)
_decode_fp8 = _decoder(_T_E4M3)
_decode_mxfp4 = _decoder(_T_E2M1X2)


# ---- GGUF blocks (gguf_quants.py) ----------------------------------------------------------------
# One walker emits, block by block, each run of 16 weights as (first k, fp32 codes, scale, min): ggml's
# w = scale * code - min. The row dot FMAs codes * x into a vector accumulator scaled per run (mins: one
# scalar term per 32 weights against xs, the block sums of x); the decoder stores scale * code - min,
# multiply then subtract like gguf-py's numpy, so the values are gguf.quants.dequantize's bit for bit.

_BLOCK_BYTES = {kind: dtype.itemsize for kind, (dtype, _) in BLOCKS.items()}
_BLOCK_WEIGHTS = {kind: qk for kind, (_, qk) in BLOCKS.items()}


def _byte(builder, bp, off):
    return builder.zext(builder.load(builder.gep(bp, [off], inbounds=True)), I32)


def _f16_at(builder, bp, off):
    """The little-endian float16 at byte offset `off` as fp32, by integer ops (no F16C needed)."""
    h = builder.zext(builder.load(builder.bitcast(builder.gep(bp, [off], inbounds=True), I16.as_pointer()), align=1), I32)
    c = lambda v: ir.Constant(I32, v)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    e = builder.and_(builder.lshr(h, c(10)), c(0x1F))
    m = builder.and_(h, c(0x3FF))
    normal = builder.or_(sign, builder.or_(builder.shl(builder.add(e, c(112)), c(23)), builder.shl(m, c(13))))
    special = builder.or_(sign, builder.or_(c(0x7F800000), builder.shl(m, c(13))))  # inf / nan
    tiny = builder.fmul(builder.uitofp(m, F32), ir.Constant(F32, 2.0**-24))  # zero / subnormal: exact
    tiny = builder.select(builder.icmp_unsigned("!=", sign, c(0)), builder.fneg(tiny), tiny)
    big = builder.bitcast(builder.select(builder.icmp_unsigned("==", e, c(31)), special, normal), F32)
    return builder.select(builder.icmp_unsigned("==", e, c(0)), tiny, big)


def _lanes(builder, bp, off):
    """16 bytes at bp[off] as int32 lanes (zero-extended)."""
    return builder.zext(vload(builder, bp, off, V8), V32)


def _k4_scale_min(builder, bp, sc, j):
    """6-bit (scale, min) of sub-block j (0..7) from a Q4_K/Q5_K block's 12 packed bytes at byte offset sc."""
    at = lambda i: _byte(builder, bp, builder.add(sc, c64(i)))
    c = lambda v: ir.Constant(I32, v)
    if j < 4:
        return builder.and_(at(j), c(63)), builder.and_(at(j + 4), c(63))
    scale = builder.or_(builder.and_(at(j + 4), c(0xF)), builder.shl(builder.lshr(at(j - 4), c(6)), c(4)))
    mn = builder.or_(builder.lshr(at(j + 4), c(4)), builder.shl(builder.lshr(at(j), c(6)), c(4)))
    return scale, mn


def _gguf_runs(builder, kind, bp, blk):
    """(k of the run's first weight within the row, fp32 codes [16], scale, min or None) for each run of
    16 weights of block `blk`, in order."""
    base = builder.mul(blk, c64(_BLOCK_BYTES[kind]))
    k0 = builder.mul(blk, c64(_BLOCK_WEIGHTS[kind]))
    at = lambda off: builder.add(base, c64(off))
    kk = lambda off: builder.add(k0, c64(off))
    vi = lambda v: cvec(V32, v)
    if kind == "Q8_0":
        d = _f16_at(builder, bp, at(0))
        for p in range(2):
            yield kk(16 * p), builder.sitofp(builder.sext(vload(builder, bp, at(2 + 16 * p), V8), V32), VF), d, None
    elif kind in ("Q4_K", "Q5_K"):
        five = kind == "Q5_K"
        d, dmin = _f16_at(builder, bp, at(0)), _f16_at(builder, bp, at(2))
        qs = 48 if five else 16
        for sub in range(8):  # 32-weight sub-blocks: run j = sub // 2, low nibbles then high nibbles
            s, m = _k4_scale_min(builder, bp, at(4), sub)
            scale = builder.fmul(d, builder.uitofp(s, F32))
            mn = builder.fmul(dmin, builder.uitofp(m, F32))
            for p in range(2):
                code = builder.and_(builder.lshr(_lanes(builder, bp, at(qs + 32 * (sub // 2) + 16 * p)),
                                                 vi(4 * (sub % 2))), vi(15))
                if five:
                    high = builder.and_(builder.lshr(_lanes(builder, bp, at(16 + 16 * p)), vi(sub)), vi(1))
                    code = builder.or_(code, builder.shl(high, vi(4)))
                yield kk(32 * sub + 16 * p), builder.sitofp(code, VF), scale, mn if p == 0 else None
    else:  # Q6_K: halves of 128, runs of 32 (low nibbles of ql[:32], of ql[32:64], then high), scales per 16
        d = _f16_at(builder, bp, at(208))
        for h in range(2):
            for r in range(4):
                for sub in range(2):
                    lo = builder.and_(builder.lshr(_lanes(builder, bp, at(64 * h + 32 * (r % 2) + 16 * sub)),
                                                   vi(4 * (r // 2))), vi(15))
                    hi = builder.and_(builder.lshr(_lanes(builder, bp, at(128 + 32 * h + 16 * sub)), vi(2 * r)), vi(3))
                    code = builder.sub(builder.or_(lo, builder.shl(hi, vi(4))), vi(32))
                    sc = builder.sitofp(builder.load(builder.gep(bp, [at(192 + 8 * h + 2 * r + sub)], inbounds=True)), F32)
                    yield kk(128 * h + 32 * r + 16 * sub), builder.sitofp(code, VF), builder.fmul(d, sc), None


def _gguf_kind(ty):
    return _T_GGUF.get(ty.dtype) if isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" else None


def _gguf_dot(kind):
    def typer(typingctx, q, x, xs):
        if _gguf_kind(q) != kind or not (is_vec(x, types.float32) and is_vec(xs, types.float32)):
            return None
        sig = types.float32(q, x, xs)

        def codegen(context, builder, sig, args):
            (qp, nb), (xp, _), (xsp, _) = array_args(context, builder, sig, args, 3)
            bp = byte_ptr(builder, qp)
            acc = cgutils.alloca_once_value(builder, cvec(VF, 0.0))
            mins = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
            with cgutils.for_range(builder, nb) as loop:
                prefetch_ahead(builder, bp, builder.mul(loop.index, c64(_BLOCK_BYTES[kind])))
                for k, codes, scale, mn in _gguf_runs(builder, kind, bp, loop.index):
                    prod = builder.fmul(codes, vload(builder, xp, k, VF))
                    builder.store(vfma(builder, prod, splat(builder, scale), builder.load(acc)), acc)
                    if mn is not None:  # sum over the 32-weight sub-block of min * x = min * xs[k / 32]
                        xsum = load_at(builder, xsp, builder.lshr(k, c64(5)))
                        builder.store(builder.fma(mn, xsum, builder.load(mins)), mins)
            return builder.fsub(hsum(builder, builder.load(acc)), builder.load(mins))

        return sig, codegen

    return intrinsic(typer)


def _gguf_decode(kind):
    def typer(typingctx, q, out):
        if _gguf_kind(q) != kind or not (is_vec(out, types.float32) or is_vec(out, types.uint16)):
            return None
        bf16 = out.dtype == types.uint16
        sig = types.void(q, out)

        def codegen(context, builder, sig, args):
            (qp, nb), (op, _) = array_args(context, builder, sig, args, 2)
            bp = byte_ptr(builder, qp)
            with cgutils.for_range(builder, nb) as loop:
                held = None
                for k, codes, scale, mn in _gguf_runs(builder, kind, bp, loop.index):
                    v = builder.fmul(splat(builder, scale), codes)
                    if kind in ("Q4_K", "Q5_K"):
                        held = mn if mn is not None else held  # the sub-block's min, from its first run
                        v = builder.fsub(v, splat(builder, held))
                    vstore(builder, round_bf16(builder, v) if bf16 else v, op, k)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


_GGUF_DOT = {kind: _gguf_dot(kind) for kind in _BLOCK_BYTES}
_GGUF_DECODE = {kind: _gguf_decode(kind) for kind in _BLOCK_BYTES}


def row_dot(qrow, srow, x, xs, group_shift):  # pragma: no cover - replaced by the overload in jit code
    raise NotImplementedError("row_dot is only callable from numba-compiled code")


def decode_row(qrow, srow, out, group_shift):  # pragma: no cover - replaced by the overload in jit code
    raise NotImplementedError("decode_row is only callable from numba-compiled code")


@overload(row_dot, inline="always")
def _row_dot_impl(qrow, srow, x, xs, group_shift):
    if qrow.dtype == types.uint8:
        return lambda qrow, srow, x, xs, group_shift: _int4_row_dot(qrow, srow, x, xs, group_shift)
    if qrow.dtype == types.int8:
        return lambda qrow, srow, x, xs, group_shift: _int8_row_dot(qrow, srow, x, group_shift)
    if qrow.dtype == types.uint16:
        return lambda qrow, srow, x, xs, group_shift: _bf16_row_dot(qrow, x)
    if qrow.dtype == _T_E4M3:  # FP8 or MXFP8: the scale row's dtype tells them apart
        return lambda qrow, srow, x, xs, group_shift: _fp8_row_dot(qrow, srow, x, group_shift)
    if qrow.dtype == _T_E2M1X2:
        return lambda qrow, srow, x, xs, group_shift: _mxfp4_row_dot(qrow, srow, x)
    gguf = _T_GGUF.get(qrow.dtype)
    if gguf is not None:
        dot = _GGUF_DOT[gguf]
        return lambda qrow, srow, x, xs, group_shift: dot(qrow, x, xs)
    return None


def _decode_bf16(qrow, srow, out, group_shift):
    bits = out.view(np.uint32)
    for j in range(qrow.shape[0]):
        bits[j] = np.uint32(qrow[j]) << np.uint32(16)


@overload(decode_row, inline="always")
def _decode_row_impl(qrow, srow, out, group_shift):
    if qrow.dtype == types.uint8:
        return lambda qrow, srow, out, group_shift: _decode_int4(qrow, srow, out, group_shift)
    if qrow.dtype == types.int8:
        return lambda qrow, srow, out, group_shift: _decode_int8(qrow, srow, out, group_shift)
    if qrow.dtype == types.uint16 and out.dtype == types.float32:
        return _decode_bf16
    if qrow.dtype == _T_E4M3:
        return lambda qrow, srow, out, group_shift: _decode_fp8(qrow, srow, out, group_shift)
    if qrow.dtype == _T_E2M1X2:
        return lambda qrow, srow, out, group_shift: _decode_mxfp4(qrow, srow, out, group_shift)
    gguf = _T_GGUF.get(qrow.dtype)
    if gguf is not None:
        decode = _GGUF_DECODE[gguf]
        return lambda qrow, srow, out, group_shift: decode(qrow, out)
    return None

# tokens of one expert from which a row is decoded once into fp32 and then dotted per token, rather
# than decoded again inside a fused row_dot per token (both ~35 G weights/s per core from L1)
DECODE_ONCE_TOKENS = 3
