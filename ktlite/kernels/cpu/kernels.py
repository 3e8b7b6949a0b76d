"""All numba code of the CPU experts: vector row primitives, the fused MoE GEMV kernel, dequantization.

One file on purpose: numba's `cache=True` only checks the timestamp of the file that defines a
cached function, not of the jitted helpers it inlines from other files, so splitting the decoders
from the kernels let a stale cache silently run an old weight layout.

Row primitives are numba intrinsics that emit LLVM vector IR directly (16 fp32 lanes = one zmm
register on AVX-512; LLVM splits them on narrower machines). Written as plain numba loops, LLVM
fully unrolled the 64-byte chunk loop and then either left it scalar (`vcvtsi2ss` per weight, int64
nibble arithmetic because numba widens integer ops to intp) or vectorized the *outer* loop with
gathers; every format then ran at ~10 G weights/s on 2 cores, bound by decoding, not memory.
Group size = 2**group_shift (32, 64 or 128), each row a whole number of 64-byte chunks (quant.py pads):

- `row_dot(qrow, srow, x, xs, group_shift)` = sum_k w[k] x[k] straight from the stored row, for
  x of length >= Kp (zero padded). Per 16 weights: widen bytes to int32 (`vpmovzxbd`/`vpmovsxbd`),
  nibble and/shift (INT4), `vcvtdq2ps`, FMA with x; the products of a 32-weight block are summed in
  a vector, multiplied by the block's scale and added to a vector accumulator (one horizontal sum per
  row). INT4's -8 offset is folded out: sum (q - 8) s x = sum s (q x) - 8 sum_b s_b xs[b], with
  xs[b] = sum of x over 32-block b (computed once per token). BF16: shift into fp32 bits + FMA.
- FP8 (E4M3 records, fp8.py) decodes like INT8 with e4m3 -> fp32 by integer shifts and one exact
  multiply by 2^120; GGUF blocks (Q4_K, Q5_K, Q6_K, Q8_0 records, gguf_quants.py) are walked run by run
  (`_gguf_runs`: 16 codes, their scale and min), the scales unpacked in scalar IR per sub-block.
- `decode_row(qrow, srow, out, group_shift)` writes the dequantized row (length Kp) into `out`:
  fp32, or bf16 bits (uint16, round to nearest even via LLVM's fptrunc to bfloat) when `out` is
  uint16 (the prefill path).

Every row loop prefetches PREFETCH_BYTES ahead of the bytes it reads: a thread walks two row streams
(gate and up) while it decodes, and the hardware prefetcher alone left INT4 decode at ~60 % of memory
bandwidth.

`moe_rows` is the fused routed-expert MLP for few tokens (per-expert GEMV, parallel over output
rows). One call runs every selected expert of one layer (one pool's share) in two parallel regions:
  1. gate/up rows: act[p, i] = SiLU(gate_i . x_t) * (up_i . x_t) for each (token t, expert) pair p;
  2. down rows:    out[t, h] += w_p * (down_h . act[p]).
Each row is dotted straight from its stored bytes with every token routed to that expert (the row
stays in L1 between tokens, so weights stream from RAM once per call however many tokens share an
expert); an expert with DECODE_ONCE_TOKENS or more tokens decodes each row once into an fp32
buffer and dots that with each token instead. Rows are split in chunks across threads; a thread
owns whole rows of `act`/`out`, so there are no races. For many tokens gemm.py's dequantize + oneDNN path is the faster one;
`scatter_add_bf16` adds its bf16 expert outputs, weighted, into the fp32 result.

`moe_amx` is moe_rows on AMX-INT8 tiles (CPUs with AMX, INT4/INT8 experts with groups of >= 64): per expert,
blocks of 32 weight rows times pairs of tiles of 16 tokens' int8 activations quantized per weight group, each group's
int32 sums rescaled (amx_block_dot, see AMX_ROWS below); INT4 rows whose group scales are whole multiples of one step
per row (fold_steps; ktlite's quantizer makes them so) unpack as code x multiple instead and sum whole rows against
activations quantized per token, a 16-row weight tile times up to four token tiles (amx_folded_block_dot).

`linear_rows` is the same GEMV for a stack of plain matrices, each with its own inputs: the device-side
Linear layers (one matrix) and per-head matrices (MLA's W_UK / W_UV) of a CPU-only run (dense_linear.py).

A CPU device's decode step runs whole blocks as one call each, so the parallel regions inside follow each other
with the worker threads still awake (one woken after Python code waits ~20 us on a 2-core VM): `mla_attention_rows`
(MLA attention from normalised input to o_proj, mla_block.py), `swiglu_rows` (a quantized SwiGLU MLP,
dense_linear.py), `moe_rows_routed` (the router's ids grouped by expert, then moe_rows and moe_amx, moe.py) and
`moe_block_rows` (a MoE layer's block from the residual stream back to it: RMSNorm, router, routed and shared
experts, moe_block.py).
"""

from __future__ import annotations

import math
import numba
import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ktlite.kernels.cpu.fp8 import E4M3
from ktlite.kernels.cpu.gguf_quants import BLOCKS
from ktlite.kernels.cpu.quantizer import INT4_MULTIPLES
from ktlite.kernels.cpu.target import amx_permitted, configure_numba
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process

CHUNK = 64  # bytes per chunk: 64 INT8 or 128 INT4 weights (quant.py's INT4 nibble layout)
XS_BLOCK = 32  # weights per entry of xs (the smallest group size)

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_LANES = 16
_T_E4M3 = numba.from_dtype(E4M3)
_T_GGUF = {numba.from_dtype(dtype): kind for kind, (dtype, _) in BLOCKS.items()}  # numba record type -> GGML type
_V8, _V16, _V32, _VF = (ir.VectorType(t, _LANES) for t in (_I8, _I16, _I32, _F32))


def _c64(v):
    return ir.Constant(_I64, v)


def _cvec(vty, val):
    return ir.Constant(vty, [val] * vty.count)


def _splat(builder, val, vty=_VF):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _vfma(builder, a, b, c):
    """a * b + c for fp32 vectors of any lane count."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fma.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def _vload(builder, base, off, vty):
    return builder.load(builder.bitcast(builder.gep(base, [off], inbounds=True), vty.as_pointer()), align=1)


def _vstore(builder, val, base, off):
    builder.store(val, builder.bitcast(builder.gep(base, [off], inbounds=True), val.type.as_pointer()), align=1)


def _load(builder, base, off):
    return builder.load(builder.gep(base, [off], inbounds=True))


# software prefetch distance: with 2 streams per thread (gate and up rows) and FMA work between loads the
# hardware prefetcher alone kept INT4 decode at ~60 % of memory bandwidth; 4 KiB ahead reaches ~100 %
PREFETCH_BYTES = 4096


def _prefetch(builder, base, off, ahead=PREFETCH_BYTES):
    """Hint that the bytes at base[off + ahead] are needed soon (llvm.prefetch: read, keep in all caches)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")
    ptr = builder.bitcast(builder.gep(base, [builder.add(off, _c64(ahead))]), _I8.as_pointer())
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _hsum(builder, v):
    """Sum of a float vector's lanes, as a halving tree (extract upper half, add)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _arrays(context, builder, sig, args, n):
    """(data pointer, length) of the first n (1-D, C-contiguous) array arguments."""
    out = []
    for ty, val in zip(sig.args[:n], args[:n]):
        a = context.make_array(ty)(context, builder, val)
        out.append((a.data, builder.extract_value(a.shape, 0)))
    return out


def _is_vec(ty, dtype=None):
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and (dtype is None or ty.dtype == dtype)


def _nibbles(builder, qp, off):
    """16 bytes at qp[off] -> (low nibbles, high nibbles) as int32 vectors."""
    z = builder.zext(_vload(builder, qp, off, _V8), _V32)
    return builder.and_(z, _cvec(_V32, 15)), builder.lshr(z, _cvec(_V32, 4))


@intrinsic
def _int4_row_dot(typingctx, q, s, x, xs, gs):
    if not (_is_vec(q, types.uint8) and _is_vec(s, types.float32) and _is_vec(x, types.float32)
            and _is_vec(xs, types.float32)):
        return None
    sig = types.float32(q, s, x, xs, types.int64)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _), (xsp, _) = _arrays(context, builder, sig, args, 4)
        gs = args[4]
        acc_lo = cgutils.alloca_once_value(builder, _cvec(_VF, 0.0))
        acc_hi = cgutils.alloca_once_value(builder, _cvec(_VF, 0.0))
        off = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
        with cgutils.for_range(builder, builder.lshr(nb, _c64(6))) as loop:
            c = loop.index
            k0 = builder.shl(c, _c64(7))  # chunk c: bytes 64c.., weights 128c..
            b0 = builder.shl(c, _c64(6))
            _prefetch(builder, qp, b0)
            sc = [_load(builder, sp, builder.lshr(builder.add(k0, _c64(32 * i)), gs)) for i in range(4)]
            o = builder.load(off)
            for i in range(4):
                o = builder.fma(sc[i], _load(builder, xsp, builder.add(builder.shl(c, _c64(2)), _c64(i))), o)
            builder.store(o, off)
            lo, hi = zip(*(_nibbles(builder, qp, builder.add(b0, _c64(16 * p))) for p in range(4)))
            part = []
            for vals, base in ((lo, 0), (hi, 64)):  # 32-weight blocks base+0 and base+32
                f = [builder.sitofp(v, _VF) for v in vals]
                xv = [_vload(builder, xp, builder.add(k0, _c64(base + 16 * p)), _VF) for p in range(4)]
                part.append(_vfma(builder, f[1], xv[1], builder.fmul(f[0], xv[0])))
                part.append(_vfma(builder, f[3], xv[3], builder.fmul(f[2], xv[2])))
            a = _vfma(builder, part[0], _splat(builder, sc[0]), builder.load(acc_lo))
            builder.store(_vfma(builder, part[1], _splat(builder, sc[1]), a), acc_lo)
            a = _vfma(builder, part[2], _splat(builder, sc[2]), builder.load(acc_hi))
            builder.store(_vfma(builder, part[3], _splat(builder, sc[3]), a), acc_hi)
        tot = _hsum(builder, builder.fadd(builder.load(acc_lo), builder.load(acc_hi)))
        return builder.fsub(tot, builder.fmul(ir.Constant(_F32, 8.0), builder.load(off)))

    return sig, codegen


@intrinsic
def _int8_row_dot(typingctx, q, s, x, gs):
    if not (_is_vec(q, types.int8) and _is_vec(s, types.float32) and _is_vec(x, types.float32)):
        return None
    sig = types.float32(q, s, x, types.int64)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _) = _arrays(context, builder, sig, args, 3)
        gs = args[3]
        accs = [cgutils.alloca_once_value(builder, _cvec(_VF, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, builder.lshr(nb, _c64(6))) as loop:
            k0 = builder.shl(loop.index, _c64(6))
            _prefetch(builder, qp, k0)
            f = [builder.sitofp(_vload(builder, qp, builder.add(k0, _c64(16 * p)), _V8), _VF) for p in range(4)]
            xv = [_vload(builder, xp, builder.add(k0, _c64(16 * p)), _VF) for p in range(4)]
            for h, acc in enumerate(accs):
                part = _vfma(builder, f[2 * h + 1], xv[2 * h + 1], builder.fmul(f[2 * h], xv[2 * h]))
                scale = _load(builder, sp, builder.lshr(builder.add(k0, _c64(32 * h)), gs))
                builder.store(_vfma(builder, part, _splat(builder, scale), builder.load(acc)), acc)
        return _hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

    return sig, codegen


# ---- int8 activations: integer dot products for INT4/INT8 rows -----------------------------------
# x quantized per 32-block b: xq[k] = round(x[k] / xd[b]) in [-127, 127], xd[b] = max |x| over b / 127
# (llama.cpp's Q8 activations, kt-kernel's AMX methods). A 32-weight block then is one integer dot
# product: vpmaddubsw (u8 x s8 -> pairs summed to int16; no saturation: |pair| <= 2 * 127 * 127) and
# vpmaddwd by ones (-> 8 int32 lanes), one int -> fp32 convert and one FMA by s_group * xd[b]. Per 32
# weights that is ~8 instructions against ~20 for the fp32 path, which left INT4 decode compute-bound
# on AVX2 (60 % of bandwidth). Without AVX2 the same sums are spelled in generic IR (slower, exact).
# With AVX-512BW the row is walked 64 bytes (two blocks) per instruction: one 512-bit multiply-add
# (vpdpbusd where the CPU has AVX512-VNNI, else vpmaddubsw + vpmaddwd), 16 lanes whose halves get the
# two blocks' scales, one FMA.

_B32, _W16, _D8, _F8 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_F2 = ir.VectorType(_F32, 2)
_B64, _W32 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32)


def int_dot_in_hardware() -> bool:
    """Whether the compile target has AVX2's byte/word multiply-adds (every x86-64 server CPU since 2013)."""
    return int_dot_path() != "generic-ir"


def int_dot_path() -> str:
    """Which integer dot the INT4/INT8 rows compile to on this target: 'avx512-vnni' (vpdpbusd on 64 bytes),
    'avx512bw' (vpmaddubsw + vpmaddwd on 64 bytes), 'avx2' (the same on 32 bytes) or 'generic-ir'."""
    target = configure_numba()
    if target.enabled("avx512bw"):
        return "avx512-vnni" if target.enabled("avx512vnni") else "avx512bw"
    return "avx2" if target.enabled("avx2") else "generic-ir"


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _pair_sums(builder, v, n):
    """Lanes (2i, 2i + 1) of an n-lane int32 vector added: n / 2 lanes."""
    even = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n // 2), list(range(1, n, 2))))
    return builder.add(even, odd)


def _block_dot(builder, w, x, w_signed):
    """32 weight bytes w (u8, or s8 if w_signed) times 32 activation bytes x (s8) -> 8 fp32 lanes whose sum
    is the block's dot product (exact: integer until the convert)."""
    if int_dot_in_hardware():
        if w_signed:  # vpmaddubsw needs an unsigned side: |w| times x with w's sign
            x = _call(builder, "llvm.x86.avx2.psign.b", _B32, [x, w])
            w = _call(builder, "llvm.abs.v32i8", _B32, [w, ir.Constant(ir.IntType(1), 0)])
        p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [w, x])
        p32 = _call(builder, "llvm.x86.avx2.pmadd.wd", _D8, [p16, _cvec(_W16, 1)])
    else:
        v32 = ir.VectorType(_I32, 32)
        wide = builder.sext(w, v32) if w_signed else builder.zext(w, v32)
        p32 = _pair_sums(builder, _pair_sums(builder, builder.mul(wide, builder.sext(x, v32)), 32), 16)
    return builder.sitofp(p32, _F8)


def _wide_block_dot(builder, w, x, w_signed):
    """64 weight bytes w times 64 activation bytes x (two 32-blocks) with AVX-512BW -> 16 fp32 lanes: lanes
    0-7 sum to the first block's dot product, 8-15 to the second's (exact: integer until the convert)."""
    if w_signed:  # no 512-bit vpsignb: negate x where w < 0 (|x| <= 127, so no overflow), then |w|
        x = builder.select(builder.icmp_signed("<", w, _cvec(_B64, 0)), builder.sub(_cvec(_B64, 0), x), x)
        w = _call(builder, "llvm.abs.v64i8", _B64, [w, ir.Constant(ir.IntType(1), 0)])
    if int_dot_path() == "avx512-vnni":
        d16 = ir.VectorType(_I32, 16)
        p32 = _call(builder, "llvm.x86.avx512.vpdpbusd.512", d16,
                    [_cvec(d16, 0), builder.bitcast(w, d16), builder.bitcast(x, d16)])
    else:
        p16 = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", _W32, [w, x])
        p32 = _call(builder, "llvm.x86.avx512.pmaddw.d.512", ir.VectorType(_I32, 16), [p16, _cvec(_W32, 1)])
    return builder.sitofp(p32, _VF)


def _halves(builder, a, b):
    """16 fp32 lanes: a in lanes 0-7, b in lanes 8-15."""
    two = builder.insert_element(builder.insert_element(ir.Constant(ir.VectorType(_F32, 2), ir.Undefined), a,
                                                        ir.Constant(_I32, 0)), b, ir.Constant(_I32, 1))
    return builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(_I32, _LANES), [0] * 8 + [1] * 8))


def _int_row_dot(w_signed):
    """row . x for an INT8 (w_signed) or INT4 row from int8 activations (xq, xd; xo: INT4's offset term
    8 xd[b] sum_b xq, so sum (q - 8) s x = sum s xd (q . xq) - sum s xo)."""

    def typer(typingctx, q, s, xq, xd, xo, gs):
        if not (_is_vec(q, types.int8 if w_signed else types.uint8) and _is_vec(s, types.float32)
                and _is_vec(xq, types.int8) and _is_vec(xd, types.float32) and _is_vec(xo, types.float32)):
            return None
        sig = types.float32(q, s, xq, xd, xo, types.int64)
        wide = int_dot_path().startswith("avx512")
        acc_ty = _VF if wide else _F8

        def codegen(context, builder, sig, args):
            (qp, nb), (sp, _), (xqp, _), (xdp, _), (xop, _) = _arrays(context, builder, sig, args, 5)
            gs = args[5]
            accs = [cgutils.alloca_once_value(builder, _cvec(acc_ty, 0.0)) for _ in range(2)]
            off = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))

            def block_scale(blk):  # (weight scale, weight scale x activation scale) of 32-block blk
                sc = _load(builder, sp, builder.lshr(builder.shl(blk, _c64(5)), gs))
                if not w_signed:
                    builder.store(builder.fma(sc, _load(builder, xop, blk), builder.load(off)), off)
                return builder.fmul(sc, _load(builder, xdp, blk))

            def add_block(w, blk, acc):  # 32 weights of block blk
                f = _block_dot(builder, w, _vload(builder, xqp, builder.shl(blk, _c64(5)), _B32), w_signed)
                builder.store(_vfma(builder, f, _splat(builder, block_scale(blk), _F8), builder.load(acc)), acc)

            off2 = cgutils.alloca_once_value(builder, _cvec(_F2, 0.0))  # the offset term's shared-scale part

            def pair_scales(blk):  # 16 lanes: weight scale x xd of block blk (lanes 0-7) and blk + 1 (8-15)
                return _halves(builder, block_scale(blk), block_scale(builder.add(blk, _c64(1))))

            def shared_pair_scales(blk):  # the same where both blocks are in one group (groups >= 64): one scale
                # load and vector work in place of two scalar chains (INT4 decode was bound by them, not by memory)
                sc = _load(builder, sp, builder.lshr(builder.shl(blk, _c64(5)), gs))
                if not w_signed:
                    xo = _vload(builder, xop, blk, _F2)
                    builder.store(_vfma(builder, _splat(builder, sc, _F2), xo, builder.load(off2)), off2)
                xd = _vload(builder, xdp, blk, _F2)
                lanes = builder.shuffle_vector(xd, xd, ir.Constant(ir.VectorType(_I32, _LANES), [0] * 8 + [1] * 8))
                return builder.fmul(_splat(builder, sc), lanes)

            def add_pair(w, blk, acc, scales):  # 64 weights of blocks blk, blk + 1
                f = _wide_block_dot(builder, w, _vload(builder, xqp, builder.shl(blk, _c64(5)), _B64), w_signed)
                builder.store(_vfma(builder, f, scales(blk), builder.load(acc)), acc)

            def row_loop(scales):
                with cgutils.for_range(builder, builder.lshr(nb, _c64(6))) as loop:  # 64 bytes a step
                    c = loop.index
                    b0 = builder.shl(c, _c64(6))
                    _prefetch(builder, qp, b0)
                    # and the scales of the weights as far ahead (the hardware prefetchers alone fall behind)
                    ahead = builder.add(b0, _c64(PREFETCH_BYTES))
                    group = builder.lshr(ahead if w_signed else builder.shl(ahead, _c64(1)), gs)
                    _prefetch(builder, builder.bitcast(sp, _I8.as_pointer()), builder.shl(group, _c64(2)), 0)
                    if wide:  # INT8: blocks 2c, 2c + 1; INT4: low nibbles 4c, 4c + 1, high nibbles 4c + 2, 4c + 3
                        raw = _vload(builder, qp, b0, _B64)
                        if w_signed:
                            add_pair(raw, builder.shl(c, _c64(1)), accs[0], scales)
                        else:
                            c4 = builder.shl(c, _c64(2))
                            add_pair(builder.and_(raw, _cvec(_B64, 15)), c4, accs[0], scales)
                            add_pair(builder.lshr(raw, _cvec(_B64, 4)), builder.add(c4, _c64(2)), accs[1], scales)
                    else:
                        for h in range(2):  # 32 bytes a half
                            raw = _vload(builder, qp, builder.add(b0, _c64(32 * h)), _B32)
                            if w_signed:
                                add_block(raw, builder.add(builder.shl(c, _c64(1)), _c64(h)), accs[h])
                            else:
                                c4 = builder.shl(c, _c64(2))
                                add_block(builder.and_(raw, _cvec(_B32, 15)), builder.add(c4, _c64(h)), accs[0])
                                add_block(builder.lshr(raw, _cvec(_B32, 4)), builder.add(c4, _c64(2 + h)), accs[1])

            if wide:
                with builder.if_else(builder.icmp_signed(">=", gs, _c64(6))) as (shared, per_block):
                    with shared:
                        row_loop(shared_pair_scales)
                    with per_block:
                        row_loop(pair_scales)
            else:
                row_loop(None)
            tot = _hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))
            if w_signed:
                return tot
            o2 = builder.load(off2)  # INT4's offset term: per-block part in off, shared-scale part in off2
            extra = builder.fadd(builder.extract_element(o2, ir.Constant(_I32, 0)),
                                 builder.extract_element(o2, ir.Constant(_I32, 1)))
            return builder.fsub(tot, builder.fadd(builder.load(off), extra))

        return sig, codegen

    return intrinsic(typer)


_int4_row_qdot = _int_row_dot(False)
_int8_row_qdot = _int_row_dot(True)


# ---- int8 activations, several tokens: a tile of TILE_ROWS rows x up to TILE_TOKENS tokens ----------------
# Row dots per token re-decode the row for every token and rebuild its scales (~12 vector ops per 64 weights
# and token). A tile walks TILE_ROWS rows and n tokens together: each 64-byte piece of a row is decoded once
# (INT4: nibbles minus 8, as signed bytes), each token's 64 activation bytes are loaded once, and a (row,
# token) pair costs four ops: vpdpbusd, convert, scale multiply, FMA. vpdpbusd multiplies unsigned by signed
# bytes, so the activations go in biased (xq + 128, an xor) and the accumulator starts at -128 * sum w (one
# vpdpbusd per row piece, shared by the tile's tokens): exact integer sums, as the row dots.
TILE_ROWS = 4  # 4 x 4 measured best of 2..8 x 2..8 (V2-Lite INT4/INT8 matrices, 48 tokens): 16 accumulators
TILE_TOKENS = 4


def int_tiles_in_hardware() -> bool:
    """Whether the tile kernels run here: they need vpdpbusd (AVX512-VNNI); elsewhere the row dots run."""
    return int_dot_path() == "avx512-vnni"


def _int_tile_dot(w_signed, n_tokens):
    """out[i, j] = row (r0 + i) . token row tix[j] for i < TILE_ROWS, j < n_tokens, from int8 activations
    (xq [P, Kp] int8, xd [P, Kp / 32]) and INT8 (w_signed) or INT4 rows (q [N, bytes], s [N, groups]); rows
    past N repeat the last one (their outputs are junk, never read)."""

    def typer(typingctx, q, s, r0, xq, xd, tix, gs, out):
        wdt = types.int8 if w_signed else types.uint8
        two_d = [(q, wdt), (s, types.float32), (xq, types.int8), (xd, types.float32), (out, types.float32)]
        if not (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == d for a, d in two_d)
                and _is_vec(tix, types.int64)):
            return None
        sig = types.void(q, s, types.int64, xq, xd, tix, types.int64, out)

        def codegen(context, builder, sig, args):
            arrs = [context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3, 4, 5, 7)]
            (qa, sa, xqa, xda, tixa, outa) = arrs
            n_rows, nb = cgutils.unpack_tuple(builder, qa.shape)
            n_groups = cgutils.unpack_tuple(builder, sa.shape)[1]
            kp = cgutils.unpack_tuple(builder, xqa.shape)[1]
            n_blocks = cgutils.unpack_tuple(builder, xda.shape)[1]
            last = builder.sub(n_rows, _c64(1))
            rows = []
            for i in range(TILE_ROWS):
                r = builder.add(args[2], _c64(i))
                r = builder.select(builder.icmp_signed(">", r, last), last, r)
                rows.append((builder.gep(qa.data, [builder.mul(r, nb)], inbounds=True),
                             builder.gep(sa.data, [builder.mul(r, n_groups)], inbounds=True)))
            toks = []
            for j in range(n_tokens):
                t = _load(builder, tixa.data, _c64(j))
                toks.append((builder.gep(xqa.data, [builder.mul(t, kp)], inbounds=True),
                             builder.gep(xda.data, [builder.mul(t, n_blocks)], inbounds=True)))
            accs = [[cgutils.alloca_once_value(builder, _cvec(_VF, 0.0)) for _ in range(n_tokens)]
                    for _ in range(TILE_ROWS)]
            d16 = ir.VectorType(_I32, 16)
            bias = _cvec(_B64, -128)  # 0x80 bytes: vpdpbusd reads them as unsigned 128

            def dpbusd(acc, unsigned, signed):
                return _call(builder, "llvm.x86.avx512.vpdpbusd.512", d16,
                             [acc, builder.bitcast(unsigned, d16), builder.bitcast(signed, d16)])

            def piece(ws, k, blk):  # signed weights ws[i] (64 each) against tokens' bytes k.., blocks blk, blk + 1
                xs = []
                for xqp, xdp in toks:
                    xu = builder.xor(_vload(builder, xqp, k, _B64), bias)
                    xs.append((xu, _halves(builder, _load(builder, xdp, blk),
                                           _load(builder, xdp, builder.add(blk, _c64(1))))))
                g0 = builder.lshr(builder.shl(blk, _c64(5)), args[6])
                g1 = builder.lshr(builder.shl(builder.add(blk, _c64(1)), _c64(5)), args[6])
                for (qp, sp), w, row_accs in zip(rows, ws, accs):
                    neg = dpbusd(_cvec(d16, 0), bias, builder.sub(_cvec(_B64, 0), w))  # -128 * sum w per 4 bytes
                    wsh = _halves(builder, _load(builder, sp, g0), _load(builder, sp, g1))
                    for (xu, xdh), acc in zip(xs, row_accs):
                        f = builder.sitofp(dpbusd(neg, xu, w), _VF)
                        builder.store(_vfma(builder, f, builder.fmul(wsh, xdh), builder.load(acc)), acc)

            with cgutils.for_range(builder, builder.lshr(nb, _c64(6))) as loop:  # 64 stored bytes a step
                c = loop.index
                b0 = builder.shl(c, _c64(6))
                raws = []
                for qp, _ in rows:
                    _prefetch(builder, qp, b0)
                    raws.append(_vload(builder, qp, b0, _B64))
                if w_signed:
                    piece(raws, b0, builder.shl(c, _c64(1)))
                else:  # low nibbles: weights 128c.., blocks 4c, 4c + 1; high nibbles: 128c + 64.., 4c + 2, 4c + 3
                    eight = _cvec(_B64, 8)
                    k0 = builder.shl(c, _c64(7))
                    c4 = builder.shl(c, _c64(2))
                    piece([builder.sub(builder.and_(w, _cvec(_B64, 15)), eight) for w in raws], k0, c4)
                    piece([builder.sub(builder.lshr(w, _cvec(_B64, 4)), eight) for w in raws],
                          builder.add(k0, _c64(64)), builder.add(c4, _c64(2)))
            n_tok_cols = cgutils.unpack_tuple(builder, outa.shape)[1]
            for i, row_accs in enumerate(accs):
                for j, acc in enumerate(row_accs):
                    dst = builder.add(builder.mul(_c64(i), n_tok_cols), _c64(j))
                    builder.store(_hsum(builder, builder.load(acc)), builder.gep(outa.data, [dst], inbounds=True))
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


_INT_TILES = {signed: tuple(_int_tile_dot(signed, n) for n in range(1, TILE_TOKENS + 1)) for signed in (False, True)}


def tile_dot_q8(q, s, r0, xq, xd, tix, group_shift, out):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("tile_dot_q8 is only callable from numba-compiled code")


@overload(tile_dot_q8, inline="always")
def _tile_dot_q8_impl(q, s, r0, xq, xd, tix, group_shift, out):
    """out[i, j] = (row r0 + i of q/s) . (int8 activation row tix[j]) for i < TILE_ROWS, j < len(tix) <= TILE_TOKENS."""
    if not isinstance(q, types.Array):
        return None
    if q.dtype not in (types.uint8, types.int8):
        # typed in kernels whose tile branch _tiled rules out for q (BF16, FP8, GGUF rows): a no-op, not a raise,
        # since a raise inside a prange body is a second exit from it and numba then runs that loop on one thread

        def unreachable(q, s, r0, xq, xd, tix, group_shift, out):
            pass

        return unreachable
    t1, t2, t3, t4 = _INT_TILES[q.dtype == types.int8]

    def impl(q, s, r0, xq, xd, tix, group_shift, out):
        n = tix.shape[0]
        if n >= 4:
            t4(q, s, r0, xq, xd, tix, group_shift, out)
        elif n == 3:
            t3(q, s, r0, xq, xd, tix, group_shift, out)
        elif n == 2:
            t2(q, s, r0, xq, xd, tix, group_shift, out)
        else:
            t1(q, s, r0, xq, xd, tix, group_shift, out)

    return impl


# AMX (Sapphire Rapids on): a tile instruction multiplies a 16 x 64 int8 tile of weights (16 rows, 64 weights
# each; INT8 rows straight from aligned storage, INT4 rows unpacked to signed bytes on the stack) by a 64 x 16 tile of
# int8 activations (16 tokens) into 16 x 16 int32 sums: 16 K multiply-adds per instruction, 64x a vpdpbusd.
# Activations are quantized per weight group for this (one scale per token and group, not per 32 values: the int32
# sums of a whole group then share one activation scale) and stored in AMX's "VNNI" layout, row k/4 holding bytes
# 4(k/4)..+3 of each of the 16 tokens. A call runs 32 rows (two weight tiles) against up to two activation tiles.
# After each weight group the int32 sums are stored and scaled (weight scale x activation scale) into fp32: with
# groups of 64 that is most of the time (same VM, per tdpbssd: 5.4 ns alone, 8.8 with its tile store, 16.8 with one
# tile's 16-vector rescale; AMX and AVX-512 work add up here, rotating the sums between tiles did not overlap them).
# So INT8 rows run one weight tile x one activation tile at a time over the whole row, the scaled sums in 16
# registers (two tile loads a multiply, weights straight from aligned storage; V3 T=128 20 % faster than 2 x 2 tiles
# with the scaled sums in memory), while INT4 rows keep 2 x 2 tiles of sums (one tile load per multiply; a multiply
# alone 4.8 ns, with one load 5.0 ns): their 64-byte steps are unpacked to signed bytes once for both activation
# tiles, and unpacking per activation tile made them 5-20 % slower. Every tile load / store is from a 64-byte
# aligned address: a tile row across two cache lines made tile loads 6x slower. The tiles' shapes are set per call
# (ldtilecfg: tile state is per thread) and released after it; Linux grants a process the tile state once
# (target.amx_permitted). Groups of 32 would need half-deep tiles: there the VNNI tiles run instead.
AMX_ROWS = 16  # rows of an AMX tile: weight rows per tile, and tokens per activation tile
AMX_BLOCK_ROWS = 2 * AMX_ROWS  # weight rows per amx_block_dot: two weight tiles
AMX_TOKEN_TILES = 2  # activation tiles per amx_block_dot of INT4 rows
AMX_MIN_GROUP = 64  # weights per group at least (one tile is 64 weights deep)
FOLDED_TOKEN_TILES = 4  # activation tiles per amx_folded_block_dot
# INT8 rows: activation tiles per amx_block_dot, and the groups from which their sums live in tiles (_int8_tiles_dot)
# rather than registers (_int8_block_dot). A/B on /tmp variants (ms, two runs each): groups of 128, V3 T=128 48.5-50.6
# -> 42.3-43.7, T=512 195-196 -> 166-170, V2-Lite T=512 52.9-53.0 -> 51.9-53.5; groups of 64 V2-Lite T=512 62-65
# -> 71-74 (a flush every step), V3 T=128 63-66 -> 61-64. Six tiles instead of four: V3 T=128 47 -> 57.
INT8_TOKEN_TILES = 4
INT8_TILES_GROUP_SHIFT = 7
SUMS_TILES = max(AMX_TOKEN_TILES, FOLDED_TOKEN_TILES, INT8_TOKEN_TILES)  # activation tiles' sums per block dot
# activation tiles' bytes a thread walks its weight blocks with (they stay in its L2: 2 MB a core on Sapphire
# Rapids): an expert with more tokens runs over its weights again per share of this size. V3 at 512 tokens per expert
# (32 tiles of 7168 x 16 bytes, 3.6 MB) took 5x its time at 128 with all tiles at once.
AMX_TILE_BYTES = 1 << 20
# INT4 (2 x 2): tmm0-3 sums, tmm4/5 the two weight tiles, tmm6/7 the two activation tiles; INT8: tmm0 / 4 / 6
_TMM_SUMS, _TMM_W, _TMM_X = 0, 4, 6


def amx_in_hardware() -> bool:
    """Whether the AMX tiles run here: the compile target has AMX-INT8 and the OS granted the tile state."""
    return configure_numba().enabled("amx-int8") and amx_permitted()


def _tile_op(builder, name, *args):
    _call(builder, f"llvm.x86.{name}", ir.VoidType(), [ir.Constant(_I8, a) if isinstance(a, int) else a for a in args])


def _tile_buffer(builder, size):
    """A stack buffer of size bytes for tile loads / stores: 64-byte aligned (a tile row that crosses a cache line
    splits the load: 6x slower tile loads on Sapphire Rapids)."""
    buf = cgutils.alloca_once(builder, ir.ArrayType(_I8, size))
    buf.align = 64
    return buf


def _tile_config(builder):
    """ldtilecfg for tmm0-7, each 16 rows x 64 bytes (int32 sums of 16 x 16, or 16 x 64 int8 operands)."""
    cfg = cgutils.alloca_once(builder, ir.ArrayType(_I8, 64))
    cfg.align = 64
    ptr = builder.bitcast(cfg, _I8.as_pointer())
    builder.store(ir.Constant(ir.ArrayType(_I8, 64), [1] + [0] * 63), cfg)  # palette 1, start row 0
    for t in range(8):
        builder.store(ir.Constant(_I16, 64), builder.bitcast(builder.gep(ptr, [_c64(16 + 2 * t)]), _I16.as_pointer()))
        builder.store(ir.Constant(_I8, AMX_ROWS), builder.gep(ptr, [_c64(48 + t)]))
    _tile_op(builder, "ldtilecfg", ptr)


class _BlockArgs:
    """amx_block_dot's arguments as LLVM values: the weight rows from r0 on (bytes), their scale rows, and activation
    tile j's int8 bytes and scales."""

    def __init__(self, context, builder, sig, args, n_tiles: int = 2):
        qa, sa, xba, xdba, self.outa = (context.make_array(sig.args[i])(context, builder, args[i])
                                        for i in (0, 1, 3, 4, 8))
        r0, t0, nt, self.gs = args[2], args[5], args[6], args[7]
        self.nb = cgutils.unpack_tuple(builder, qa.shape)[1]  # stored bytes of a row
        n_groups = cgutils.unpack_tuple(builder, sa.shape)[1]
        tile_bytes = builder.mul(cgutils.unpack_tuple(builder, xba.shape)[1], _c64(64))
        self.qbase = builder.bitcast(builder.gep(qa.data, [builder.mul(r0, self.nb)], inbounds=True), _I8.as_pointer())
        self.row_scales = [builder.gep(sa.data, [builder.mul(builder.add(r0, _c64(i)), n_groups)])
                           for i in range(AMX_BLOCK_ROWS)]
        tiles = [builder.add(t0, _c64(j)) for j in range(n_tiles)]
        self.used = [builder.icmp_signed(">", nt, _c64(j)) for j in range(n_tiles)]
        self.x = [builder.bitcast(builder.gep(xba.data, [builder.mul(t, tile_bytes)]), _I8.as_pointer()) for t in tiles]
        self.xd = [builder.gep(xdba.data, [builder.mul(t, builder.mul(n_groups, _c64(AMX_ROWS)))]) for t in tiles]
        self.last = builder.sub(builder.shl(_c64(1), self.gs), _c64(64))  # k & (group - 1) of a group's last 64

    def group_ends(self, builder, k):
        """Whether weights k..k + 63 are their group's last."""
        return builder.icmp_unsigned("==", builder.and_(k, builder.add(self.last, _c64(63))), self.last)


def _block_dot_types(q, s, xb, xdb, out) -> bool:
    return (isinstance(q, types.Array) and q.dtype in (types.int8, types.uint8)
            and all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == d and a.ndim == n
                    for a, d, n in ((q, q.dtype, 2), (s, types.float32, 2), (xb, types.int8, 3),
                                    (xdb, types.float32, 3), (out, types.float32, 3))))


@intrinsic
def amx_block_dot(typingctx, q, s, r0, xb, xdb, t0, nt, gs, out):
    """out[j, i, c] = (row r0 + i of q/s) . (token c of activation tile t0 + j) for i < 32, c < 16 and j < nt <=
    AMX_TOKEN_TILES (INT4) / INT8_TOKEN_TILES (INT8): q/s [N, ...] INT8 (int8) or INT4 (uint8) rows, N >= r0 + 32;
    xb [tiles, Kp / 4, 64] int8 activation tiles in VNNI layout, xdb [tiles, Kp >> gs, 16] their scales per group;
    out [>= nt, 32, 16]. INT4 rows: 2 x 2 tiles of sums, each 64-byte step unpacked once for both activation tiles
    (_int4_block_dot); INT8 rows in groups of >= 2**INT8_TILES_GROUP_SHIFT: one weight tile x the activation tiles,
    their sums in tiles (_int8_tiles_dot); in smaller groups one weight tile x one activation tile at a time, the
    scaled sums in registers (_int8_block_dot)."""
    if not _block_dot_types(q, s, xb, xdb, out):
        return None
    sig = types.void(q, s, types.int64, xb, xdb, types.int64, types.int64, types.int64, out)
    int8 = q.dtype == types.int8

    def codegen(context, builder, sig, args):
        if int8:
            a = _BlockArgs(context, builder, sig, args, INT8_TOKEN_TILES)
            with builder.if_else(builder.icmp_signed(">=", a.gs, _c64(INT8_TILES_GROUP_SHIFT))) as (long, short):
                with long:
                    _int8_tiles_dot(builder, a)
                with short:
                    _int8_block_dot(builder, a)
        else:
            _int4_block_dot(builder, _BlockArgs(context, builder, sig, args))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def amx_folded_block_dot(typingctx, q, s, r0, xb, xdb, t0, nt, gs, out, m):
    """amx_block_dot for INT4 rows whose group scales are whole multiples of one step per row (fold_steps): s [N, 1]
    the steps, m [32, G] int8 the multiples of rows r0..r0 + 31, xdb [tiles, 1, 16] one activation scale per token,
    j < nt <= FOLDED_TOKEN_TILES. Each weight is unpacked as code x m, so the int32 sums run the whole row in the
    tiles and are scaled once, by step x activation scale: no per-group rescale, which costs twice the multiply."""
    if not (_block_dot_types(q, s, xb, xdb, out) and q.dtype == types.uint8 and isinstance(m, types.Array)
            and m.dtype == types.int8 and m.ndim == 2 and m.layout == "C"):
        return None
    sig = types.void(q, s, types.int64, xb, xdb, types.int64, types.int64, types.int64, out, m)

    def codegen(context, builder, sig, args):
        ma = context.make_array(sig.args[9])(context, builder, args[9])
        _int4_folded_dot(builder, _BlockArgs(context, builder, sig, args, FOLDED_TOKEN_TILES), ma)
        return context.get_dummy_value()

    return sig, codegen


def _times_m_tables(builder):
    """Byte tables code -> (code - 8) x m for m = -INT4_MULTIPLES..INT4_MULTIPLES, 16 bytes each (vpshufb's)."""
    name = "ktlite_int4_times_m"
    table = builder.module.globals.get(name)
    if table is None:
        values = [(n - 8) * m for m in range(-INT4_MULTIPLES, INT4_MULTIPLES + 1) for n in range(16)]
        table = cgutils.global_constant(builder.module, name, ir.Constant(ir.ArrayType(_I8, len(values)), values))
        table.align = 16
    return builder.bitcast(table, _I8.as_pointer())


def _times_m(builder, tables, m, nibbles):
    """(nibbles - 8) x m for 64 nibbles (bytes 0..15) and one multiple m (i8): its table in each 16-byte lane."""
    at = builder.mul(builder.add(builder.sext(m, _I64), _c64(INT4_MULTIPLES)), _c64(16))
    lane = builder.load(builder.bitcast(builder.gep(tables, [at]), ir.VectorType(_I8, 16).as_pointer()), align=1)
    table = builder.shuffle_vector(lane, ir.Constant(ir.VectorType(_I8, 16), None),
                                   ir.Constant(ir.VectorType(_I32, 64), [n % 16 for n in range(64)]))
    return _call(builder, "llvm.x86.avx512.pshuf.b.512", _B64, [table, nibbles])


def _unpack_int4(builder, a: _BlockArgs, rows: range, step, unpacked, decode):
    """Rows `rows` of the block, 64 stored bytes each (128 weights: low nibbles weights 0-63 of the step, high nibbles
    64-127, quant.py) into unpacked (128 bytes a row, the low half first) as decode(row, half, nibbles) gives them."""
    b0 = builder.shl(step, _c64(6))
    for n, i in enumerate(rows):
        w = _vload(builder, a.qbase, builder.add(b0, builder.mul(_c64(i), a.nb)), _B64)
        for half, nibbles in enumerate((builder.and_(w, _cvec(_B64, 15)), builder.lshr(w, _cvec(_B64, 4)))):
            _vstore(builder, decode(i, half, nibbles), unpacked, _c64(128 * n + 64 * half))


def _int4_block_dot(builder, a: _BlockArgs):
    """32 INT4 rows (two weight tiles, unpacked to signed bytes on the stack a 64-byte step at a time) x up to two
    activation tiles: four tiles of sums, one tile load per multiply; after each group the sums are stored and
    scaled into out."""
    bp = _I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, 4 * AMX_ROWS * 64), bp)
    unpacked = builder.bitcast(_tile_buffer(builder, AMX_BLOCK_ROWS * 128), bp)
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            op = builder.gep(a.outa.data, [_c64(j * AMX_BLOCK_ROWS * AMX_ROWS)])
            for i in range(AMX_BLOCK_ROWS):
                _vstore(builder, _cvec(_VF, 0.0), op, _c64(16 * i))
    _tile_config(builder)
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            _tile_op(builder, "tilezero", 2 * j)
            _tile_op(builder, "tilezero", 2 * j + 1)

    def flush(g):  # the sums of group g, scaled, into out; sums zeroed
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                for w in range(2):
                    _tile_op(builder, "tilestored64", 2 * j + w, builder.gep(sums, [_c64(1024 * (2 * j + w))]),
                             _c64(64))
                    _tile_op(builder, "tilezero", 2 * j + w)

        def scale(n_tiles):  # rows outer: one weight-scale broadcast live at a time (all 32 at once spilled)
            xds = [_vload(builder, xdp, builder.shl(g, _c64(4)), _VF) for xdp in a.xd[:n_tiles]]
            for i in range(AMX_BLOCK_ROWS):  # sums tile 2 j + i // 16: row i at byte 2048 j + 64 i
                w = _splat(builder, _load(builder, a.row_scales[i], g))
                for j, xd in enumerate(xds):
                    c = _vload(builder, sums, _c64(2048 * j + 64 * i), _V32)
                    op = builder.gep(a.outa.data, [_c64(j * AMX_BLOCK_ROWS * AMX_ROWS + 16 * i)])
                    _vstore(builder, _vfma(builder, builder.sitofp(c, _VF), builder.fmul(w, xd),
                                           _vload(builder, op, _c64(0), _VF)), op, _c64(0))

        with builder.if_else(a.used[1]) as (two, one):
            with two:
                scale(2)
            with one:
                scale(1)

    def step(weights, k):  # weight tiles at weights[0], weights[1] (weights k..k + 63) x activation tiles
        for w, wp in enumerate(weights):
            _tile_op(builder, "tileloadd64", _TMM_W + w, wp, _c64(128))
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                _tile_op(builder, "tileloadd64", _TMM_X + j, builder.gep(a.x[j], [builder.shl(k, _c64(4))]), _c64(64))
                for w in range(2):
                    _tile_op(builder, "tdpbssd", 2 * j + w, _TMM_W + w, _TMM_X + j)
        with builder.if_then(a.group_ends(builder, k)):
            flush(builder.lshr(k, a.gs))

    with cgutils.for_range(builder, builder.lshr(a.nb, _c64(6))) as loop:  # 64 stored bytes of each row a step
        # the block 32 rows on (contiguous, the next call but one for gate/up) read in order: 32 lines a step
        ahead = builder.add(builder.mul(_c64(AMX_BLOCK_ROWS), a.nb), builder.shl(loop.index, _c64(11)))
        for i in range(AMX_BLOCK_ROWS):
            _prefetch(builder, a.qbase, ahead, 64 * i)
        eight = _cvec(_B64, 8)
        _unpack_int4(builder, a, range(AMX_BLOCK_ROWS), loop.index, unpacked, lambda i, half, v: builder.sub(v, eight))
        k0 = builder.shl(loop.index, _c64(7))
        for half in range(2):
            step([builder.gep(unpacked, [_c64(64 * half + 128 * AMX_ROWS * w)]) for w in range(2)],
                 builder.add(k0, _c64(64 * half)))
    _tile_op(builder, "tilerelease")


def _int4_folded_dot(builder, a: _BlockArgs, multiples):
    """32 INT4 rows whose scales fold (amx_folded_block_dot), one weight tile of 16 at a time over the whole row x up
    to FOLDED_TOKEN_TILES activation tiles: each 64-byte step of the 16 rows unpacked once (code x m, a vpshufb table
    per row and group) for all of them, the int32 sums in tmm0-3 until the row ends, then scaled once into out."""
    bp = _I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    unpacked = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 128), bp)
    tables = _times_m_tables(builder)
    n_groups = cgutils.unpack_tuple(builder, multiples.shape)[1]
    _tile_config(builder)
    for w in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = range(AMX_ROWS * w, AMX_ROWS * (w + 1))
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                _tile_op(builder, "tilezero", j)

        def times_m(i, half, nibbles):
            g = builder.lshr(builder.add(k0, _c64(64 * half)), a.gs)
            return _times_m(builder, tables, _load(builder, multiples.data, builder.add(builder.mul(_c64(i), n_groups),
                                                                                          g)), nibbles)

        with cgutils.for_range(builder, builder.lshr(a.nb, _c64(6))) as loop:  # 64 stored bytes of each row a step
            k0 = builder.shl(loop.index, _c64(7))
            # the next 16 rows (the other weight tile, then the next block) read in the same order: 16 lines a step
            ahead = builder.add(builder.mul(_c64(AMX_ROWS * (w + 1)), a.nb), builder.shl(loop.index, _c64(6)))
            for i in range(AMX_ROWS):
                _prefetch(builder, a.qbase, ahead, 0)
                ahead = builder.add(ahead, a.nb)
            _unpack_int4(builder, a, rows, loop.index, unpacked, times_m)
            for half in range(2):
                k = builder.add(k0, _c64(64 * half))
                _tile_op(builder, "tileloadd64", _TMM_W + half, builder.gep(unpacked, [_c64(64 * half)]), _c64(128))
                for j, used in enumerate(a.used):
                    with builder.if_then(used):
                        x = _TMM_X + (2 * half + j) % 2
                        _tile_op(builder, "tileloadd64", x, builder.gep(a.x[j], [builder.shl(k, _c64(4))]), _c64(64))
                        _tile_op(builder, "tdpbssd", j, _TMM_W + half, x)
        for j, used in enumerate(a.used):  # out[j, row] = sums x step of the row x the tokens' scales
            with builder.if_then(used):
                _tile_op(builder, "tilestored64", j, sums, _c64(64))
                _scaled_into_out(builder, a, sums, rows, j, _c64(0), False)
    _tile_op(builder, "tilerelease")


def _scaled_into_out(builder, a: _BlockArgs, sums, rows: range, j: int, g, add: bool) -> None:
    """out[j, i] = (or += with add) row n of the stored sums tile x (row i's weight scale of group g x activation tile
    j's token scales of group g) for the block rows i = rows[n]."""
    xd = _vload(builder, a.xd[j], builder.shl(g, _c64(4)), _VF)
    for n, i in enumerate(rows):
        c = builder.sitofp(_vload(builder, sums, _c64(64 * n), _V32), _VF)
        scale = builder.fmul(_splat(builder, _load(builder, a.row_scales[i], g)), xd)
        off = _c64(j * AMX_BLOCK_ROWS * AMX_ROWS + AMX_ROWS * i)
        _vstore(builder, _vfma(builder, c, scale, _vload(builder, a.outa.data, off, _VF)) if add
                else builder.fmul(c, scale), a.outa.data, off)


def _int8_tiles_dot(builder, a: _BlockArgs):
    """32 INT8 rows, one weight tile of 16 at a time over the whole row x up to INT8_TOKEN_TILES activation tiles
    (tmm0-3 their sums): each weight tile loaded once a step for all of them; after each group the sums are stored and
    scaled into out."""
    bp = _I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    copied = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(a.qbase, _I64), _c64(63)), _c64(0))
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            for i in range(AMX_BLOCK_ROWS):
                _vstore(builder, _cvec(_VF, 0.0), a.outa.data, _c64(j * AMX_BLOCK_ROWS * AMX_ROWS + AMX_ROWS * i))
    _tile_config(builder)
    for w in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = builder.gep(a.qbase, [builder.mul(a.nb, _c64(AMX_ROWS * w))])
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                _tile_op(builder, "tilezero", j)

        def step(weights, stride, k):
            _tile_op(builder, "tileloadd64", _TMM_W, weights, stride)
            for j, used in enumerate(a.used):
                with builder.if_then(used):
                    x = _TMM_X + j % 2
                    _tile_op(builder, "tileloadd64", x, builder.gep(a.x[j], [builder.shl(k, _c64(4))]), _c64(64))
                    _tile_op(builder, "tdpbssd", j, _TMM_W, x)
            with builder.if_then(a.group_ends(builder, k)):
                for j, used in enumerate(a.used):
                    with builder.if_then(used):
                        _tile_op(builder, "tilestored64", j, sums, _c64(64))
                        _tile_op(builder, "tilezero", j)
                        _scaled_into_out(builder, a, sums, range(AMX_ROWS * w, AMX_ROWS * (w + 1)), j,
                                         builder.lshr(k, a.gs), True)

        _int8_row_steps(builder, a, rows, aligned, copied, step, True)
    _tile_op(builder, "tilerelease")


def _int8_row_steps(builder, a: _BlockArgs, rows, aligned, copied, step, prefetch: bool) -> None:
    """step(weights, stride, k) for each 64-weight step k of the 16 INT8 rows from `rows`, the weight tile straight
    from storage where the rows start on cache lines, else copied first (a tile row across two lines loads 6x
    slower); with prefetch, these rows' next steps are prefetched."""
    with cgutils.for_range(builder, builder.lshr(a.nb, _c64(6))) as loop:
        k = builder.shl(loop.index, _c64(6))
        offs = [builder.add(k, builder.mul(_c64(i), a.nb)) for i in range(AMX_ROWS)]
        if prefetch:
            for off in offs:
                _prefetch(builder, rows, off, 512)
        with builder.if_else(aligned) as (direct, unaligned):
            with direct:
                step(builder.gep(rows, [k]), a.nb, k)
            with unaligned:
                for i, off in enumerate(offs):
                    _vstore(builder, _vload(builder, rows, off, _B64), copied, _c64(64 * i))
                step(copied, _c64(64), k)


def _int8_block_dot(builder, a: _BlockArgs):
    """32 INT8 rows as two weight tiles, each against each activation tile in turn over the whole row: one tile of
    sums, stored after each group and scaled into 16 fp32 vectors that stay in registers (no load / store of out
    per group), two tile loads a multiply (weights straight from storage when it starts on cache lines)."""
    bp = _I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    copied = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(a.qbase, _I64), _c64(63)), _c64(0))
    accs = [cgutils.alloca_once(builder, _VF) for _ in range(AMX_ROWS)]  # registers after mem2reg
    _tile_config(builder)
    _tile_op(builder, "tilezero", _TMM_SUMS)
    for half in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = builder.gep(a.qbase, [builder.mul(a.nb, _c64(AMX_ROWS * half))])
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                for acc in accs:
                    builder.store(_cvec(_VF, 0.0), acc)

                def step(weights, stride, k):  # weights k..k + 63 of the 16 rows x activation tile j
                    _tile_op(builder, "tileloadd64", _TMM_W, weights, stride)
                    _tile_op(builder, "tileloadd64", _TMM_X, builder.gep(a.x[j], [builder.shl(k, _c64(4))]), _c64(64))
                    _tile_op(builder, "tdpbssd", _TMM_SUMS, _TMM_W, _TMM_X)
                    with builder.if_then(a.group_ends(builder, k)):
                        _tile_op(builder, "tilestored64", _TMM_SUMS, sums, _c64(64))
                        _tile_op(builder, "tilezero", _TMM_SUMS)
                        g = builder.lshr(k, a.gs)
                        xd = _vload(builder, a.xd[j], builder.shl(g, _c64(4)), _VF)
                        for i, acc in enumerate(accs):
                            c = builder.sitofp(_vload(builder, sums, _c64(64 * i), _V32), _VF)
                            scale = builder.fmul(_splat(builder, _load(builder, a.row_scales[AMX_ROWS * half + i], g)),
                                                 xd)
                            builder.store(_vfma(builder, c, scale, builder.load(acc)), acc)

                # the rows' next steps prefetched once, for this activation tile and the next
                _int8_row_steps(builder, a, rows, aligned, copied, step, j == 0)
                op = builder.gep(a.outa.data, [_c64(j * AMX_BLOCK_ROWS * AMX_ROWS + AMX_ROWS * AMX_ROWS * half)])
                for i, acc in enumerate(accs):
                    _vstore(builder, builder.load(acc), op, _c64(16 * i))
    _tile_op(builder, "tilerelease")


@intrinsic
def abs_max(typingctx, x):
    """max |x| of a C-contiguous fp32 vector whose length is a multiple of 16, 16 lanes at a time (numba's loop
    of max(m, abs(v)) stays scalar: ~1 ns a value, most of the activation quantizer's time)."""
    if not _is_vec(x, types.float32):
        return None
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        (xp, n), = _arrays(context, builder, sig, args, 1)
        m = cgutils.alloca_once_value(builder, _cvec(_VF, 0.0))
        with cgutils.for_range(builder, builder.lshr(n, _c64(4))) as loop:
            v = _call(builder, "llvm.fabs.v16f32", _VF, [_vload(builder, xp, builder.shl(loop.index, _c64(4)), _VF)])
            builder.store(_call(builder, "llvm.maxnum.v16f32", _VF, [builder.load(m), v]), m)
        return _call(builder, "llvm.vector.reduce.fmax.v16f32", _F32, [builder.load(m)])

    return sig, codegen


@intrinsic
def scale_to_codes(typingctx, x, inv, q):
    """q = int8(rint(x * inv)) elementwise (x C-contiguous fp32, q int8 of the same length, a multiple of 16; |x *
    inv| <= 127.5), 16 lanes at a time: the activation quantizer's loop stays scalar in numba (~1 ns a value)."""
    if not (_is_vec(x, types.float32) and inv == types.float32 and _is_vec(q, types.int8)):
        return None
    sig = types.void(x, inv, q)

    def codegen(context, builder, sig, args):
        (xp, n), = _arrays(context, builder, sig, args, 1)
        qp = context.make_array(sig.args[2])(context, builder, args[2]).data
        scale = _splat(builder, args[1])
        with cgutils.for_range(builder, builder.lshr(n, _c64(4))) as loop:
            k = builder.shl(loop.index, _c64(4))
            v = _call(builder, "llvm.rint.v16f32", _VF, [builder.fmul(_vload(builder, xp, k, _VF), scale)])
            _vstore(builder, builder.trunc(builder.fptosi(v, _V32), _V8), qp, k)
        return context.get_dummy_value()

    return sig, codegen


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
        with cgutils.for_range(builder, builder.lshr(ga.nitems, _c64(4))) as loop:
            k = builder.shl(loop.index, _c64(4))
            gv = _vload(builder, ga.data, k, _VF)
            neg = builder.fneg(_call(builder, "llvm.minnum.v16f32", _VF, [
                _call(builder, "llvm.maxnum.v16f32", _VF, [gv, _cvec(_VF, -87.0)]), _cvec(_VF, 87.0)]))
            n = _call(builder, "llvm.rint.v16f32", _VF, [builder.fmul(neg, _cvec(_VF, math.log2(math.e)))])
            r = _vfma(builder, n, _cvec(_VF, -_LN2_LO), _vfma(builder, n, _cvec(_VF, -_LN2_HI), neg))
            poly = _cvec(_VF, _EXP_TAYLOR[-1])
            for c in reversed(_EXP_TAYLOR[:-1]):
                poly = _vfma(builder, poly, r, _cvec(_VF, c))
            two_n = builder.bitcast(builder.shl(builder.add(builder.fptosi(n, _V32), _cvec(_V32, 127)),
                                                _cvec(_V32, 23)), _VF)
            denom = _vfma(builder, poly, two_n, _cvec(_VF, 1.0))
            _vstore(builder, builder.fdiv(builder.fmul(gv, _vload(builder, ua.data, k, _VF)), denom), ga.data, k)
        return context.get_dummy_value()

    return sig, codegen


# perfect-shuffle masks: lane 2i of a row pair's interleave is row a's lane i (+ 8 for the upper half), 2i + 1 row b's
_INTERLEAVE = [ir.Constant(ir.VectorType(_I32, _LANES), [h + i // 2 + _LANES * (i % 2) for i in range(_LANES)])
               for h in (0, _LANES // 2)]


@intrinsic
def transpose_sums(typingctx, src, dst):
    """dst[c, i] = src[i, c] for src [32, 16] (amx_block_dot's sums of one activation tile: weight rows x tokens) and
    dst [16, 32] (tokens x rows, fp32, C-contiguous), so each token's 32 results are one contiguous run: two 16 x 16
    transposes in registers, each four rounds of the perfect shuffle (row i interleaved with row i + 8)."""
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
               for a in (src, dst)):
        return None
    sig = types.void(src, dst)

    def codegen(context, builder, sig, args):
        sa, da = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args))
        for half in range(AMX_BLOCK_ROWS // _LANES):
            rows = [_vload(builder, sa.data, _c64(_LANES * (_LANES * half + i)), _VF) for i in range(_LANES)]
            for _ in range(4):  # log2(16) rounds
                rows = [builder.shuffle_vector(rows[i // 2], rows[i // 2 + _LANES // 2], _INTERLEAVE[i % 2])
                        for i in range(_LANES)]
            for c in range(_LANES):
                _vstore(builder, rows[c], da.data, _c64(AMX_BLOCK_ROWS * c + _LANES * half))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tile_into_rows(typingctx, by_token, dst, rows, p0, n, w, col0, skip):
    """dst[rows[p0 + c], col0 + i] = by_token[c, i] (w empty) or += w[p0 + c] * by_token[c, i], for c < n and
    skip <= i < 32: one transposed tile of sums (transpose_sums) into its pairs' rows of act / out, two masked 16-lane
    stores a pair. Numba's loop over each pair's row slice took ~40 ns a pair: 20 ms of a 75 ms V3 down projection
    at 512 tokens."""
    if not (all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 and a.ndim == d
                for a, d in ((by_token, 2), (dst, 2), (w, 1))) and _is_vec(rows, types.int64)):
        return None
    sig = types.void(by_token, dst, rows, types.int64, types.int64, w, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        ba, da, ra, wa = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 2, 5))
        p0, n, col0, skip = args[3], args[4], args[6], args[7]
        width = cgutils.unpack_tuple(builder, da.shape)[1]
        add = builder.icmp_signed(">", cgutils.unpack_tuple(builder, wa.shape)[0], _c64(0))
        mask_ty, ptr_ty, align = ir.VectorType(ir.IntType(1), _LANES), _VF.as_pointer(), ir.Constant(_I32, 4)
        masked_load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF, [ptr_ty, _I32, mask_ty, _VF]), "llvm.masked.load.v16f32.p0")
        masked_store = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_VF, ptr_ty, _I32, mask_ty]), "llvm.masked.store.v16f32.p0")
        lanes = ir.VectorType(_I64, _LANES)
        masks = [builder.icmp_signed(">=", ir.Constant(lanes, [h * _LANES + i for i in range(_LANES)]),
                                     _splat(builder, skip, lanes)) for h in range(AMX_BLOCK_ROWS // _LANES)]
        with cgutils.for_range(builder, n) as loop:
            p = builder.add(p0, loop.index)
            base = builder.gep(da.data, [builder.add(builder.mul(_load(builder, ra.data, p), width), col0)],
                               inbounds=True)
            for h, mask in enumerate(masks):
                v = _vload(builder, ba.data, builder.add(builder.mul(loop.index, _c64(AMX_BLOCK_ROWS)),
                                                           _c64(h * _LANES)), _VF)
                ptr = builder.bitcast(builder.gep(base, [_c64(h * _LANES)], inbounds=True), ptr_ty)
                with builder.if_else(add) as (weighted, stored):
                    with weighted:
                        old = builder.call(masked_load, [ptr, align, mask, _cvec(_VF, 0.0)])
                        v_add = _vfma(builder, v, _splat(builder, _load(builder, wa.data, p)), old)
                        builder.call(masked_store, [v_add, ptr, align, mask])
                    with stored:
                        builder.call(masked_store, [v, ptr, align, mask])
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


_TWO_POW_120 = ir.Constant(_F32, 2.0**120)


def _e4m3_to_f32(builder, z):
    """e4m3fn bit patterns (zero-extended to int32 lanes) -> their exact fp32 values. Sign to bit 31,
    exponent and mantissa (7 bits) to bits 26..20: that is the value scaled by 2^-120 (exponent bias 127
    instead of 7; e4m3 subnormals land on fp32 subnormals), so one multiply by 2^120 (exact) restores
    it. NaN (0x7f/0xff) is not preserved; checkpoints hold none."""
    # byte to bits 31..24, arithmetic shift by 4 (sign copies into 30..27, the rest to 26..20), clear 30..27:
    # three integer ops per lane where sign and magnitude apart take five (the decode is compute-bound on AVX2)
    top = builder.shl(z, _cvec(_V32, 24))
    bits = builder.and_(builder.ashr(top, _cvec(_V32, 4)), _cvec(_V32, -0x78100000))  # 0x87F00000 as int32
    return builder.fmul(builder.bitcast(bits, _VF), _splat(builder, _TWO_POW_120))


def _byte_ptr(builder, ptr):
    return builder.bitcast(ptr, _I8.as_pointer())


@intrinsic
def _fp8_row_dot(typingctx, q, s, x, gs):
    if not (_is_vec(q, _T_E4M3) and _is_vec(s, types.float32) and _is_vec(x, types.float32)):
        return None
    sig = types.float32(q, s, x, types.int64)

    def codegen(context, builder, sig, args):
        (qp, nb), (sp, _), (xp, _) = _arrays(context, builder, sig, args, 3)
        qp = _byte_ptr(builder, qp)
        gs = args[3]
        accs = [cgutils.alloca_once_value(builder, _cvec(_VF, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, builder.lshr(nb, _c64(6))) as loop:
            k0 = builder.shl(loop.index, _c64(6))
            _prefetch(builder, qp, k0)
            f = [_e4m3_to_f32(builder, builder.zext(_vload(builder, qp, builder.add(k0, _c64(16 * p)), _V8), _V32))
                 for p in range(4)]
            xv = [_vload(builder, xp, builder.add(k0, _c64(16 * p)), _VF) for p in range(4)]
            for h, acc in enumerate(accs):  # 32-weight halves: a group is at least 32 wide
                part = _vfma(builder, f[2 * h + 1], xv[2 * h + 1], builder.fmul(f[2 * h], xv[2 * h]))
                scale = _load(builder, sp, builder.lshr(builder.add(k0, _c64(32 * h)), gs))
                builder.store(_vfma(builder, part, _splat(builder, scale), builder.load(acc)), acc)
        return _hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))

    return sig, codegen


def _bf16_to_f32(builder, bits16):
    return builder.bitcast(builder.shl(builder.zext(bits16, _V32), _cvec(_V32, 16)), _VF)


def _bf16_scalar_to_f32(builder, bits16):
    return builder.bitcast(builder.shl(builder.zext(bits16, _I32), ir.Constant(_I32, 16)), _F32)


@intrinsic
def _bf16_row_dot(typingctx, q, x):
    if not (_is_vec(q, types.uint16) and _is_vec(x, types.float32)):
        return None
    sig = types.float32(q, x)

    def codegen(context, builder, sig, args):
        (qp, n), (xp, _) = _arrays(context, builder, sig, args, 2)
        accs = [cgutils.alloca_once_value(builder, _cvec(_VF, 0.0)) for _ in range(4)]
        with cgutils.for_range(builder, builder.lshr(n, _c64(6))) as loop:  # 64 weights per step
            k0 = builder.shl(loop.index, _c64(6))
            _prefetch(builder, qp, k0)  # uint16 elements: twice the distance in bytes
            for p, acc in enumerate(accs):
                k = builder.add(k0, _c64(16 * p))
                w = _bf16_to_f32(builder, _vload(builder, qp, k, _V16))
                builder.store(_vfma(builder, w, _vload(builder, xp, k, _VF), builder.load(acc)), acc)
        tot = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                           builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        res = cgutils.alloca_once_value(builder, _hsum(builder, tot))
        start = builder.and_(n, _c64(~63))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:  # BF16 rows are not padded
            k = builder.add(start, loop.index)
            w = _bf16_scalar_to_f32(builder, _load(builder, qp, k))
            builder.store(builder.fma(w, _load(builder, xp, k), builder.load(res)), res)
        return builder.load(res)

    return sig, codegen


@intrinsic
def _f32_dot(typingctx, a, b):
    if not (_is_vec(a, types.float32) and _is_vec(b, types.float32)):
        return None
    sig = types.float32(a, b)

    def codegen(context, builder, sig, args):
        (ap, n), (bp, _) = _arrays(context, builder, sig, args, 2)
        accs = [cgutils.alloca_once_value(builder, _cvec(_VF, 0.0)) for _ in range(4)]
        with cgutils.for_range(builder, builder.lshr(n, _c64(6))) as loop:  # 64 per step
            k0 = builder.shl(loop.index, _c64(6))
            for p, acc in enumerate(accs):
                k = builder.add(k0, _c64(16 * p))
                builder.store(_vfma(builder, _vload(builder, ap, k, _VF), _vload(builder, bp, k, _VF),
                                    builder.load(acc)), acc)
        tot = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                           builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
        res = cgutils.alloca_once_value(builder, _hsum(builder, tot))
        start = builder.and_(n, _c64(~63))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:
            k = builder.add(start, loop.index)
            builder.store(builder.fma(_load(builder, ap, k), _load(builder, bp, k), builder.load(res)), res)
        return builder.load(res)

    return sig, codegen


class _BFloat(ir.Type):
    """LLVM's bfloat (llvmlite has no class for it): fptrunc to it lets LLVM pick vcvtneps2bf16 on CPUs
    with AVX512-BF16."""

    def _to_string(self):
        return "bfloat"


_VBF = ir.VectorType(_BFloat(), _LANES)


def _native_bf16() -> bool:
    """Whether the compile target converts to bf16 in hardware. Elsewhere LLVM lowers fptrunc to bfloat
    as a call to compiler-rt's __truncsfbf2, which the JIT cannot resolve (the process aborts), so the
    rounding is spelled out in integer ops instead."""
    return configure_numba().enabled("avx512bf16")


def _round_bf16(builder, v):
    """fp32 vector -> bf16 bits, round to nearest even (as torch's .to(bfloat16) for finite values)."""
    if _native_bf16():
        return builder.bitcast(builder.fptrunc(v, _VBF), _V16)
    bits = builder.bitcast(v, _V32)
    odd = builder.and_(builder.lshr(bits, _cvec(_V32, 16)), _cvec(_V32, 1))  # ties go to the even neighbour
    rounded = builder.add(bits, builder.add(odd, _cvec(_V32, 0x7FFF)))
    return builder.trunc(builder.lshr(rounded, _cvec(_V32, 16)), _V16)


def _decoder(qdtype):
    """decode_row for one byte-coded format: INT4 (uint8 nibbles), INT8 (int8) or FP8 (E4M3 records)."""

    def typer(typingctx, q, s, out, gs):
        if not (_is_vec(q, qdtype) and _is_vec(s, types.float32) and (_is_vec(out, types.float32)
                                                                        or _is_vec(out, types.uint16))):
            return None
        bf16 = out.dtype == types.uint16
        sig = types.void(q, s, out, types.int64)

        def codegen(context, builder, sig, args):
            (qp, nb), (sp, _), (op, _) = _arrays(context, builder, sig, args, 3)
            qp = _byte_ptr(builder, qp)
            gs = args[3]

            def put(v, k):  # v: fp32 lanes of weights k..k+15 before their group's scale
                v = builder.fmul(v, _splat(builder, _load(builder, sp, builder.lshr(k, gs))))
                _vstore(builder, _round_bf16(builder, v) if bf16 else v, op, k)

            with cgutils.for_range(builder, builder.lshr(nb, _c64(6))) as loop:
                b0 = builder.shl(loop.index, _c64(6))
                _prefetch(builder, qp, b0)
                if qdtype == types.uint8:
                    k0 = builder.shl(loop.index, _c64(7))
                    for p in range(4):
                        lo, hi = _nibbles(builder, qp, builder.add(b0, _c64(16 * p)))
                        put(builder.sitofp(builder.sub(lo, _cvec(_V32, 8)), _VF), builder.add(k0, _c64(16 * p)))
                        put(builder.sitofp(builder.sub(hi, _cvec(_V32, 8)), _VF), builder.add(k0, _c64(64 + 16 * p)))
                else:
                    for p in range(4):
                        k = builder.add(b0, _c64(16 * p))
                        raw = _vload(builder, qp, k, _V8)
                        if qdtype == types.int8:
                            put(builder.sitofp(builder.sext(raw, _V32), _VF), k)
                        else:
                            put(_e4m3_to_f32(builder, builder.zext(raw, _V32)), k)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


_decode_int4 = _decoder(types.uint8)
_decode_int8 = _decoder(types.int8)
_decode_fp8 = _decoder(_T_E4M3)


# ---- GGUF blocks (gguf_quants.py) ----------------------------------------------------------------
# One walker emits, block by block, each run of 16 weights as (first k, fp32 codes, scale, min): ggml's
# w = scale * code - min. The row dot FMAs codes * x into a vector accumulator scaled per run (mins: one
# scalar term per 32 weights against xs, the block sums of x); the decoder stores scale * code - min,
# multiply then subtract like gguf-py's numpy, so the values are gguf.quants.dequantize's bit for bit.

_BLOCK_BYTES = {kind: dtype.itemsize for kind, (dtype, _) in BLOCKS.items()}
_BLOCK_WEIGHTS = {kind: qk for kind, (_, qk) in BLOCKS.items()}


def _byte(builder, bp, off):
    return builder.zext(builder.load(builder.gep(bp, [off], inbounds=True)), _I32)


def _f16_at(builder, bp, off):
    """The little-endian float16 at byte offset `off` as fp32, by integer ops (no F16C needed)."""
    h = builder.zext(builder.load(builder.bitcast(builder.gep(bp, [off], inbounds=True), _I16.as_pointer()), align=1), _I32)
    c = lambda v: ir.Constant(_I32, v)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    e = builder.and_(builder.lshr(h, c(10)), c(0x1F))
    m = builder.and_(h, c(0x3FF))
    normal = builder.or_(sign, builder.or_(builder.shl(builder.add(e, c(112)), c(23)), builder.shl(m, c(13))))
    special = builder.or_(sign, builder.or_(c(0x7F800000), builder.shl(m, c(13))))  # inf / nan
    tiny = builder.fmul(builder.uitofp(m, _F32), ir.Constant(_F32, 2.0**-24))  # zero / subnormal: exact
    tiny = builder.select(builder.icmp_unsigned("!=", sign, c(0)), builder.fneg(tiny), tiny)
    big = builder.bitcast(builder.select(builder.icmp_unsigned("==", e, c(31)), special, normal), _F32)
    return builder.select(builder.icmp_unsigned("==", e, c(0)), tiny, big)


def _lanes(builder, bp, off):
    """16 bytes at bp[off] as int32 lanes (zero-extended)."""
    return builder.zext(_vload(builder, bp, off, _V8), _V32)


def _k4_scale_min(builder, bp, sc, j):
    """6-bit (scale, min) of sub-block j (0..7) from a Q4_K/Q5_K block's 12 packed bytes at byte offset sc."""
    at = lambda i: _byte(builder, bp, builder.add(sc, _c64(i)))
    c = lambda v: ir.Constant(_I32, v)
    if j < 4:
        return builder.and_(at(j), c(63)), builder.and_(at(j + 4), c(63))
    scale = builder.or_(builder.and_(at(j + 4), c(0xF)), builder.shl(builder.lshr(at(j - 4), c(6)), c(4)))
    mn = builder.or_(builder.lshr(at(j + 4), c(4)), builder.shl(builder.lshr(at(j), c(6)), c(4)))
    return scale, mn


def _gguf_runs(builder, kind, bp, blk):
    """(k of the run's first weight within the row, fp32 codes [16], scale, min or None) for each run of
    16 weights of block `blk`, in order."""
    base = builder.mul(blk, _c64(_BLOCK_BYTES[kind]))
    k0 = builder.mul(blk, _c64(_BLOCK_WEIGHTS[kind]))
    at = lambda off: builder.add(base, _c64(off))
    kk = lambda off: builder.add(k0, _c64(off))
    vi = lambda v: _cvec(_V32, v)
    if kind == "Q8_0":
        d = _f16_at(builder, bp, at(0))
        for p in range(2):
            yield kk(16 * p), builder.sitofp(builder.sext(_vload(builder, bp, at(2 + 16 * p), _V8), _V32), _VF), d, None
    elif kind in ("Q4_K", "Q5_K"):
        five = kind == "Q5_K"
        d, dmin = _f16_at(builder, bp, at(0)), _f16_at(builder, bp, at(2))
        qs = 48 if five else 16
        for sub in range(8):  # 32-weight sub-blocks: run j = sub // 2, low nibbles then high nibbles
            s, m = _k4_scale_min(builder, bp, at(4), sub)
            scale = builder.fmul(d, builder.uitofp(s, _F32))
            mn = builder.fmul(dmin, builder.uitofp(m, _F32))
            for p in range(2):
                code = builder.and_(builder.lshr(_lanes(builder, bp, at(qs + 32 * (sub // 2) + 16 * p)),
                                                 vi(4 * (sub % 2))), vi(15))
                if five:
                    high = builder.and_(builder.lshr(_lanes(builder, bp, at(16 + 16 * p)), vi(sub)), vi(1))
                    code = builder.or_(code, builder.shl(high, vi(4)))
                yield kk(32 * sub + 16 * p), builder.sitofp(code, _VF), scale, mn if p == 0 else None
    else:  # Q6_K: halves of 128, runs of 32 (low nibbles of ql[:32], of ql[32:64], then high), scales per 16
        d = _f16_at(builder, bp, at(208))
        for h in range(2):
            for r in range(4):
                for sub in range(2):
                    lo = builder.and_(builder.lshr(_lanes(builder, bp, at(64 * h + 32 * (r % 2) + 16 * sub)),
                                                   vi(4 * (r // 2))), vi(15))
                    hi = builder.and_(builder.lshr(_lanes(builder, bp, at(128 + 32 * h + 16 * sub)), vi(2 * r)), vi(3))
                    code = builder.sub(builder.or_(lo, builder.shl(hi, vi(4))), vi(32))
                    sc = builder.sitofp(builder.load(builder.gep(bp, [at(192 + 8 * h + 2 * r + sub)], inbounds=True)), _F32)
                    yield kk(128 * h + 32 * r + 16 * sub), builder.sitofp(code, _VF), builder.fmul(d, sc), None


def _gguf_kind(ty):
    return _T_GGUF.get(ty.dtype) if isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" else None


def _gguf_dot(kind):
    def typer(typingctx, q, x, xs):
        if _gguf_kind(q) != kind or not (_is_vec(x, types.float32) and _is_vec(xs, types.float32)):
            return None
        sig = types.float32(q, x, xs)

        def codegen(context, builder, sig, args):
            (qp, nb), (xp, _), (xsp, _) = _arrays(context, builder, sig, args, 3)
            bp = _byte_ptr(builder, qp)
            acc = cgutils.alloca_once_value(builder, _cvec(_VF, 0.0))
            mins = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
            with cgutils.for_range(builder, nb) as loop:
                _prefetch(builder, bp, builder.mul(loop.index, _c64(_BLOCK_BYTES[kind])))
                for k, codes, scale, mn in _gguf_runs(builder, kind, bp, loop.index):
                    prod = builder.fmul(codes, _vload(builder, xp, k, _VF))
                    builder.store(_vfma(builder, prod, _splat(builder, scale), builder.load(acc)), acc)
                    if mn is not None:  # sum over the 32-weight sub-block of min * x = min * xs[k / 32]
                        xsum = _load(builder, xsp, builder.lshr(k, _c64(5)))
                        builder.store(builder.fma(mn, xsum, builder.load(mins)), mins)
            return builder.fsub(_hsum(builder, builder.load(acc)), builder.load(mins))

        return sig, codegen

    return intrinsic(typer)


def _gguf_decode(kind):
    def typer(typingctx, q, out):
        if _gguf_kind(q) != kind or not (_is_vec(out, types.float32) or _is_vec(out, types.uint16)):
            return None
        bf16 = out.dtype == types.uint16
        sig = types.void(q, out)

        def codegen(context, builder, sig, args):
            (qp, nb), (op, _) = _arrays(context, builder, sig, args, 2)
            bp = _byte_ptr(builder, qp)
            with cgutils.for_range(builder, nb) as loop:
                held = None
                for k, codes, scale, mn in _gguf_runs(builder, kind, bp, loop.index):
                    v = builder.fmul(_splat(builder, scale), codes)
                    if kind in ("Q4_K", "Q5_K"):
                        held = mn if mn is not None else held  # the sub-block's min, from its first run
                        v = builder.fsub(v, _splat(builder, held))
                    _vstore(builder, _round_bf16(builder, v) if bf16 else v, op, k)
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
    if qrow.dtype == _T_E4M3:
        return lambda qrow, srow, x, xs, group_shift: _fp8_row_dot(qrow, srow, x, group_shift)
    gguf = _T_GGUF.get(qrow.dtype)
    if gguf is not None:
        dot = _GGUF_DOT[gguf]
        return lambda qrow, srow, x, xs, group_shift: dot(qrow, x, xs)
    return None


def row_dot_q8(qrow, srow, x, xs, xq, xd, xo, group_shift):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("row_dot_q8 is only callable from numba-compiled code")


@overload(row_dot_q8, inline="always")
def _row_dot_q8_impl(qrow, srow, x, xs, xq, xd, xo, group_shift):
    """row . x from the int8 activations (xq, xd, xo: quantize_activations) for INT4/INT8 rows; any other
    format from x itself, as row_dot."""
    if qrow.dtype == types.uint8:
        return lambda qrow, srow, x, xs, xq, xd, xo, group_shift: _int4_row_qdot(qrow, srow, xq, xd, xo, group_shift)
    if qrow.dtype == types.int8:
        return lambda qrow, srow, x, xs, xq, xd, xo, group_shift: _int8_row_qdot(qrow, srow, xq, xd, xo, group_shift)
    return lambda qrow, srow, x, xs, xq, xd, xo, group_shift: row_dot(qrow, srow, x, xs, group_shift)


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
    gguf = _T_GGUF.get(qrow.dtype)
    if gguf is not None:
        decode = _GGUF_DECODE[gguf]
        return lambda qrow, srow, out, group_shift: decode(qrow, out)
    return None


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


ROWS_PER_CHUNK = 16  # rows per parallel task of linear_rows
# tokens of one expert from which a row is decoded once into fp32 and then dotted per token, rather
# than decoded again inside a fused row_dot per token (both ~35 G weights/s per core from L1)
DECODE_ONCE_TOKENS = 3


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def moe_rows(x, slots, tok_ptr, tok_idx, tok_w, gu_q, gu_s, d_q, d_s, gu_shift, d_shift, q8, scratch, act, out):
    """x [T, Kp(hidden)] fp32, zero beyond hidden; slots [M] expert slots into the stacked weights;
    pairs tok_ptr[m]:tok_ptr[m+1] of expert m are tokens tok_idx[p] with weights tok_w[p];
    gu_q/gu_s [E, 2I, ...] (gate rows then up rows), d_q/d_s [E, H, ...], each in its own storage format
    with its own group shift; q8: INT4/INT8 rows dot int8 activations (x and act quantized per 32-block,
    row_dot_q8) instead of fp32 ones; scratch [threads, 2, >= max Kp] fp32 row buffers (one pair per thread:
    allocating them inside prange page-faulted and ran up to 20x slower; `threads` is also the number of parallel
    tasks, each a share of the rows); act [P, Kp(inter)] fp32 scratch, zero beyond I (only act[:, :I] is
    written); out [T, H] fp32, accumulated into."""
    hidden = out.shape[1]
    inter = gu_q.shape[1] // 2
    kp_h = x.shape[1]
    kp_i = act.shape[1]
    n_experts = slots.shape[0]
    xs, xq, xd, xo = _activation_views(x, q8)
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
            if _tiled(q8, gu_q, tok_ptr[m + 1] - tok_ptr[m]):
                _gate_up_tiles(gu_q[e], gu_s[e], r_lo, r_hi, xq, xd, tok_idx, tok_ptr[m], tok_ptr[m + 1], gu_shift,
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
                        g = _f32_dot(bg, x[t])
                        u = _f32_dot(bu, x[t])
                    elif q8:
                        g = row_dot_q8(gq, gsc, x[t], xs[t], xq[t], xd[t], xo[t], gu_shift)
                        u = row_dot_q8(uq, usc, x[t], xs[t], xq[t], xd[t], xo[t], gu_shift)
                    else:
                        g = row_dot(gq, gsc, x[t], xs[t], gu_shift)
                        u = row_dot(uq, usc, x[t], xs[t], gu_shift)
                    act[p, i] = g / (np.float32(1.0) + np.exp(-g)) * u
    acts, aq, ad, ao = _activation_views(act, q8)
    pairs = np.arange(act.shape[0])  # the tiles' row indices into aq / ad
    share = (hidden + threads - 1) // threads
    for task in prange(threads):
        tid = get_thread_id()
        bd = scratch[tid, 0, :kp_i]
        h_lo, h_hi = task * share, min(hidden, (task + 1) * share)
        for m in range(n_experts):
            e = slots[m]
            p_lo, p_hi = tok_ptr[m], tok_ptr[m + 1]
            if _tiled(q8, d_q, p_hi - p_lo):
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
                            v = _f32_dot(bd, act[p])
                        elif q8:
                            v = row_dot_q8(dq, dsc, act[p], acts[p], aq[p], ad[p], ao[p], d_shift)
                        else:
                            v = row_dot(dq, dsc, act[p], acts[p], d_shift)
                        out[tok_idx[p], h] += tok_w[p] * v


# with INT_TILES an expert with this many tokens or more runs as tiles (one token: the row dot, as fast)
TILE_MIN_TOKENS = 2
INT_TILES = int_tiles_in_hardware()
AMX = amx_in_hardware()


def _int_rows(q):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("_int_rows is only callable from numba-compiled code")


@overload(_int_rows, inline="always")
def _int_rows_impl(q):
    """Whether stored matrices q hold INT4/INT8 rows (a constant of q's type)."""
    answer = q.dtype in (types.uint8, types.int8)
    return lambda q: answer


@njit(nogil=True, cache=True, inline="always")
def _tiled(q8, q, n_tokens):
    """Whether n_tokens int8-activation dots against the rows of stored matrices q run as tiles (INT4/INT8 rows)."""
    return INT_TILES and q8 and _int_rows(q) and n_tokens >= TILE_MIN_TOKENS


@njit(nogil=True, cache=True, inline="always")
def _gate_up_tiles(q, s, r_lo, r_hi, xq, xd, tok_idx, p_lo, p_hi, group_shift, tiles, act):
    """act[p, i] = SiLU(gate_i . x_t) * (up_i . x_t) for rows r_lo <= i < r_hi of one expert (q/s [2I, ...]: gate
    rows, then up rows) and its pairs p_lo <= p < p_hi (token t = tok_idx[p]), as tiles; tiles [2, rows, tokens]."""
    inter = q.shape[0] // 2
    for r0 in range(r_lo, r_hi, TILE_ROWS):
        for p0 in range(p_lo, p_hi, TILE_TOKENS):
            tix = tok_idx[p0:min(p_hi, p0 + TILE_TOKENS)]
            tile_dot_q8(q, s, r0, xq, xd, tix, group_shift, tiles[0])
            tile_dot_q8(q, s, inter + r0, xq, xd, tix, group_shift, tiles[1])
            for i in range(min(TILE_ROWS, r_hi - r0)):
                for j in range(tix.shape[0]):
                    g = tiles[0, i, j]
                    act[p0 + j, r0 + i] = g / (np.float32(1.0) + np.exp(-g)) * tiles[1, i, j]


@njit(nogil=True, cache=True)
def _activation_views(x, q8):
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
def _stacked_inputs(x, kp):
    """x [T, G, K] -> [T * G, kp] fp32, row t * G + g token t's input to matrix g, zeros past K."""
    tokens, groups = x.shape[0], x.shape[1]
    xp = np.zeros((tokens * groups, kp), np.float32)
    for t in range(tokens):
        for g in range(groups):
            xp[t * groups + g, :x.shape[2]] = x[t, g]
    return xp


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def linear_rows(x, q, s, group_shift, kp, q8, threads, out):
    """out [T, G, N] fp32: out[t, g] = W_g @ x[t, g] for G stacked matrices W_g (q/s [G, N, ...], any storage
    format, rows of kp weights): the device-side Linear layers (G = 1) and per-head matrices (MLA's W_UK /
    W_UV, G = heads) of a CPU-only run (dense_linear.py). x [T, G, K] fp32 (K <= kp; padded with zeros here,
    where it costs no Python); q8 as in moe_rows; threads: numba's thread count (the per-thread row buffers).
    As moe_rows for one expert: parallel over chunks of output rows of every matrix, each row dotted from its
    stored bytes with every token, or (fp32 activations) from DECODE_ONCE_TOKENS tokens on, decoded once into
    fp32 and dotted from there."""
    tokens, groups = x.shape[0], x.shape[1]
    rows = q.shape[1]
    xp = _stacked_inputs(x, kp)
    xs, xq, xd, xo = _activation_views(xp, q8)
    once = not q8 and tokens >= DECODE_ONCE_TOKENS
    tiled = _tiled(q8, q, tokens)
    # row buffers allocated before the parallel region (inside it they page-faulted: see moe_rows)
    scratch = np.empty((threads if once else 0, kp), np.float32)
    tiles = np.empty((threads if tiled else 0, TILE_ROWS, TILE_TOKENS), np.float32)
    xrow = np.empty((groups, tokens), np.int64)  # xrow[g, t]: the row of xp (xq, xd) with token t's input to W_g
    for g in range(groups):
        xrow[g] = np.arange(tokens) * groups + g
    chunks = (rows + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    for task in prange(groups * chunks):
        g = task // chunks
        c = task - g * chunks
        n_hi = min(rows, (c + 1) * ROWS_PER_CHUNK)
        if tiled:
            tile = tiles[get_thread_id()]
            for n0 in range(c * ROWS_PER_CHUNK, n_hi, TILE_ROWS):
                for t0 in range(0, tokens, TILE_TOKENS):
                    tix = xrow[g, t0:min(tokens, t0 + TILE_TOKENS)]
                    tile_dot_q8(q[g], s[g], n0, xq, xd, tix, group_shift, tile)
                    for i in range(min(TILE_ROWS, n_hi - n0)):
                        for j in range(tix.shape[0]):
                            out[t0 + j, g, n0 + i] = tile[i, j]
            continue
        for n in range(c * ROWS_PER_CHUNK, n_hi):
            qr, sr = q[g, n], s[g, n]
            if once:
                buf = scratch[get_thread_id()]
                decode_row(qr, sr, buf, group_shift)
                for t in range(tokens):
                    out[t, g, n] = _f32_dot(buf, xp[t * groups + g])
            elif q8:
                for t in range(tokens):
                    r = t * groups + g
                    out[t, g, n] = row_dot_q8(qr, sr, xp[r], xs[r], xq[r], xd[r], xo[r], group_shift)
            else:
                for t in range(tokens):
                    r = t * groups + g
                    out[t, g, n] = row_dot(qr, sr, xp[r], xs[r], group_shift)


@njit(nogil=True, cache=True)
def project_rows(x, w, threads):
    """linear_rows for a compiled caller: x [T, G, K] (C-contiguous) through stored matrices w = (qweight, scales,
    group_shift, kp, q8) -> a fresh [T, G, N] fp32 array."""
    q, s, group_shift, kp, q8 = w
    out = np.empty((x.shape[0], q.shape[0], q.shape[1]), np.float32)
    linear_rows(x, q, s, group_shift, kp, q8, threads, out)
    return out


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
    xp = _stacked_inputs(x, kp)
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


@njit(parallel=True, nogil=True, cache=True)
def dequant_rows_f32(q, s, group_shift, kp, scratch, out):
    """q/s [N, ...] one stored INT8/INT4 matrix -> out fp32 [N, K] (K <= kp); scratch [threads, 2,
    >= kp] fp32 row buffers, used when K < kp (one per thread: allocating inside prange page-faults)."""
    k = out.shape[1]
    for n in prange(q.shape[0]):
        if k == kp:
            decode_row(q[n], s[n], out[n], group_shift)
        else:
            buf = scratch[get_thread_id(), 0, :kp]
            decode_row(q[n], s[n], buf, group_shift)
            out[n, :] = buf[:k]


@njit(parallel=True, nogil=True, cache=True)
def dequant_rows_bf16(q, s, group_shift, kp, scratch, out):
    """q/s [N, ...] one stored INT8/INT4 matrix -> out uint16 bf16 bits [N, K] (K <= kp), round to
    nearest even; scratch as in dequant_rows_f32."""
    k = out.shape[1]
    for n in prange(q.shape[0]):
        if k == kp:
            decode_row(q[n], s[n], out[n], group_shift)
        else:
            buf = scratch[get_thread_id(), 0].view(np.uint16)[:kp]
            decode_row(q[n], s[n], buf, group_shift)
            out[n, :] = buf[:k]


@intrinsic
def _bf16_axpy(typingctx, out, w, y):
    """out += w * y for fp32 `out` and bf16-bits `y` (1-D, same length)."""
    if not (_is_vec(out, types.float32) and w == types.float32 and _is_vec(y, types.uint16)):
        return None
    sig = types.void(out, w, y)

    def codegen(context, builder, sig, args):
        (op, n), (yp, _) = _arrays(context, builder, types.void(sig.args[0], sig.args[2]), [args[0], args[2]], 2)
        wv = _splat(builder, args[1])
        with cgutils.for_range(builder, builder.lshr(n, _c64(4))) as loop:
            k = builder.shl(loop.index, _c64(4))
            y16 = _bf16_to_f32(builder, _vload(builder, yp, k, _V16))
            _vstore(builder, _vfma(builder, wv, y16, _vload(builder, op, k, _VF)), op, k)
        start = builder.and_(n, _c64(~15))
        with cgutils.for_range(builder, builder.sub(n, start)) as loop:
            k = builder.add(start, loop.index)
            yk = _bf16_scalar_to_f32(builder, _load(builder, yp, k))
            builder.store(builder.fma(args[1], yk, _load(builder, op, k)), builder.gep(op, [k], inbounds=True))
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


# ---- a decode step's blocks in one call each (a CPU device: attention.py, moe.py, dense_linear.py) ----

MIN_SPLIT = 64  # positions per run below which splitting a request's attention costs more than it spreads


@njit(nogil=True, cache=True)
def decode_splits(batch, longest, threads):
    """Runs per request of mla_decode_latents: enough (batch x runs) work items for `threads` threads, none shorter
    than MIN_SPLIT. One rule for both callers: the split sets the summation order."""
    return max(1, min((threads + batch - 1) // batch, longest // MIN_SPLIT))


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def mla_decode_latents(q, kv, req_to_token, rows, lens, sm_scale, kv_lora, runs, out):  # pragma: no cover - compiled
    """Absorbed-MLA decode attention over a latent pool (attention.mla_decode's kernel): out [B, H, kv_lora] from
    q [B, H, kv_lora + rope], kv [slots, kv_lora + rope], each request's positions split into `runs` runs."""
    batch, heads, width = q.shape
    run_max = np.full((batch, runs, heads), -np.inf, np.float32)
    run_sum = np.zeros((batch, runs, heads), np.float32)
    run_out = np.zeros((batch, runs, heads, kv_lora), np.float32)
    for item in prange(batch * runs):
        b, r = item // runs, item % runs
        length = (lens[b] + runs - 1) // runs
        lo, hi = r * length, min(lens[b], (r + 1) * length)
        if lo >= hi:
            continue
        scores = np.empty((heads, hi - lo), np.float32)
        for i in range(lo, hi):
            slot = req_to_token[rows[b], i]
            for h in range(heads):
                acc = np.float32(0.0)
                for d in range(width):
                    acc += q[b, h, d] * kv[slot, d]
                scores[h, i - lo] = acc * sm_scale
        for h in range(heads):
            top = scores[h].max()
            total = np.float32(0.0)
            for i in range(hi - lo):
                scores[h, i] = np.exp(scores[h, i] - top)
                total += scores[h, i]
            run_max[b, r, h], run_sum[b, r, h] = top, total
        for i in range(lo, hi):
            slot = req_to_token[rows[b], i]
            for h in range(heads):
                p = scores[h, i - lo]
                for d in range(kv_lora):
                    run_out[b, r, h, d] += p * kv[slot, d]
    for item in prange(batch * heads):  # merge the runs: rescale each to the overall max
        b, h = item // heads, item % heads
        top = run_max[b, :, h].max()
        total = np.float32(0.0)
        for d in range(kv_lora):
            out[b, h, d] = 0.0
        for r in range(runs):
            if run_sum[b, r, h] == 0.0:
                continue
            scale = np.exp(run_max[b, r, h] - top)
            total += scale * run_sum[b, r, h]
            for d in range(kv_lora):
                out[b, h, d] += scale * run_out[b, r, h, d]
        for d in range(kv_lora):
            out[b, h, d] /= total


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
    gu_shift, d_shift, kp_h, kp_i, q8, scratch, amx_from, threads, gu_steps, d_steps, work): CPUMoE.decode_experts;
    work: >= T * k * kp_i fp32, the fused kernels' intermediate rows (reused across calls: a fresh one page-faults,
    ~10 % of a 512-token V3 layer)."""
    (slot_of, pool_of, n_pools, gu_q, gu_s, d_q, d_s, gu_shift, d_shift, kp_h, kp_i, q8, scratch, amx_from, threads,
     gu_steps, d_steps, work) = experts
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
        moe_rows(xp, r_slots, r_ptr, r_idx, r_w, gu_q, gu_s, d_q, d_s, gu_shift, d_shift, q8, scratch, act, out)
    if tiles.any():
        a_slots, a_ptr, a_idx, a_w = _selected_slots(slots, tok_ptr, tok_idx, tok_w, tiles)
        act = pair_rows(work, a_idx.shape[0], kp_i, inter)
        _moe_amx_on_int_rows(xp, a_slots, a_ptr, a_idx, a_w, gu_q, gu_s, gu_steps, d_q, d_s, d_steps, gu_shift, d_shift,
                             threads, act, out)
    return out, missing


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


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def router_logits(h, w):  # pragma: no cover - compiled
    """h [T, H] @ w [E, H].T in fp32: a MoE router's logits."""
    out = np.empty((h.shape[0], w.shape[0]), np.float32)
    for e in prange(w.shape[0]):
        for t in range(h.shape[0]):
            acc = np.float32(0.0)
            for i in range(h.shape[1]):
                acc += h[t, i] * w[e, i]
            out[t, e] = acc
    return out


@njit(nogil=True, cache=True)
def _largest(values, out):
    """The indices of the out.size largest values into out, largest first (the first index among equal values)."""
    taken = np.zeros(values.shape[0], np.bool_)
    for j in range(out.shape[0]):
        best = -1
        for e in range(values.shape[0]):
            if not taken[e] and (best < 0 or values[e] > values[best]):
                best = e
        taken[best] = True
        out[j] = best


@njit(nogil=True, cache=True)
def route_rows(logits, bias, route):  # pragma: no cover - compiled
    """select_experts (runtime/models/router.py) of logits [T, E] in fp32 -> (ids int64 [T, k], weights fp32 [T, k]).
    route = (sigmoid, method, n_group, topk_group, top_k, normalize, scaling_factor), method 0 greedy, 1
    group_limited_greedy, 2 noaux_tc (router.route_args); bias: the correction bias, empty without one."""
    sigmoid, method, n_group, topk_group, top_k, normalize, scaling = route
    tokens, experts = logits.shape
    per_group = experts // n_group
    ids = np.empty((tokens, top_k), np.int64)
    weights = np.empty((tokens, top_k), np.float32)
    scores = np.empty(experts, np.float32)
    choice = np.empty(experts, np.float32)
    group_scores = np.empty(n_group, np.float32)
    kept = np.empty(topk_group, np.int64)
    for t in range(tokens):
        row = logits[t]
        if sigmoid:
            for e in range(experts):
                scores[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-row[e]))
        else:
            top = row.max()
            total = np.float32(0.0)
            for e in range(experts):
                scores[e] = np.exp(row[e] - top)
                total += scores[e]
            for e in range(experts):
                scores[e] /= total
        for e in range(experts):  # the bias steers the choice only
            choice[e] = scores[e] + bias[e] if bias.size else scores[e]
        if method > 0:  # the best topk_group groups only: noaux_tc scores a group by its top-2, else by its best
            for g in range(n_group):
                group = choice[g * per_group:(g + 1) * per_group]
                first = np.argmax(group)
                second = -np.inf
                for i in range(per_group):
                    if i != first and group[i] > second:
                        second = group[i]
                group_scores[g] = group[first] + second if method == 2 else group[first]
            _largest(group_scores, kept)
            for g in range(n_group):
                if not (kept == g).any():
                    choice[g * per_group:(g + 1) * per_group] = -np.inf if method == 2 else np.float32(0.0)
        _largest(choice, ids[t])
        for j in range(top_k):
            weights[t, j] = scores[ids[t, j]]
        if normalize:
            weights[t] /= weights[t].sum() + np.float32(1e-20)
        if scaling != 1.0:
            weights[t] *= scaling
    return ids, weights


@njit(nogil=True, cache=True)
def rms_scaled(x, weight, eps, out):  # pragma: no cover - compiled
    """out = weight * x / rms(x), in fp32 (RMSNorm without unit offset)."""
    total = 0.0  # float64: a sum closer to torch's pairwise fp32 one than a running fp32 sum
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * x[i]
    inv = np.float32(1.0 / np.sqrt(np.float32(total / x.shape[0]) + eps))
    for i in range(x.shape[0]):
        out[i] = weight[i] * (x[i] * inv)


@njit(nogil=True, cache=True)
def rope_rotated(x, cos, sin, interleave, out):  # pragma: no cover - compiled
    """out = x rotated by cos/sin [rot // 2] (rope.apply_rope over all of x: pairs (2i, 2i+1) or halves)."""
    half = cos.shape[0]
    for i in range(half):
        a, b = (x[2 * i], x[2 * i + 1]) if interleave else (x[i], x[i + half])
        first, second = a * cos[i] - b * sin[i], b * cos[i] + a * sin[i]
        if interleave:
            out[2 * i], out[2 * i + 1] = first, second
        else:
            out[i], out[i + half] = first, second


@njit(nogil=True, cache=True)
def mla_attention_rows(h, block, kv, cos, sin, slots, req_to_token, rows, prefix_lens):  # pragma: no cover - compiled
    """A decode batch's absorbed-MLA attention from normalised input to output projection (mla_block.py: the
    arguments, and when this runs); block = (q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, eps, interleave, dims,
    sm_scale, threads), dims = (heads, nope, rope, kv_lora)."""
    q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, eps, interleave, dims, sm_scale, threads = block
    tokens = h.shape[0]
    heads, nope, rope, kv_lora = dims
    qk = nope + rope
    both = project_rows(h.reshape(tokens, 1, h.shape[1]), q_kv_a, threads)[:, 0]  # [T, q width + kv_lora + rope]
    q_width = both.shape[1] - kv_lora - rope
    for t in range(tokens):  # the new latents, straight into the pool
        entry = kv[slots[t]]
        rms_scaled(both[t, q_width:q_width + kv_lora], kv_norm, eps, entry[:kv_lora])
        rope_rotated(both[t, q_width + kv_lora:], cos[t], sin[t], interleave, entry[kv_lora:])
    if q_a_norm.shape[0]:  # a query LoRA: q = q_b_proj(q_a_layernorm(q_a))
        q_a = np.empty((tokens, 1, q_width), np.float32)
        for t in range(tokens):
            rms_scaled(both[t, :q_width], q_a_norm, eps, q_a[t, 0])
        q = project_rows(q_a, q_b, threads)[:, 0]
    else:
        q = both[:, :q_width]
    q_nope = np.empty((tokens, heads, nope), np.float32)
    q_abs = np.empty((tokens, heads, kv_lora + rope), np.float32)
    for t in range(tokens):
        for g in range(heads):
            q_nope[t, g] = q[t, g * qk:g * qk + nope]
            rope_rotated(q[t, g * qk + nope:(g + 1) * qk], cos[t], sin[t], interleave, q_abs[t, g, kv_lora:])
    q_abs[:, :, :kv_lora] = project_rows(q_nope, uk, threads)
    lens = prefix_lens + 1
    runs = decode_splits(tokens, lens.max(), threads)
    attn = np.empty((tokens, heads, kv_lora), np.float32)
    mla_decode_latents(q_abs, kv, req_to_token, rows, lens, sm_scale, kv_lora, runs, attn)
    v = project_rows(attn, uv, threads)  # [T, heads, v_head]
    return project_rows(v.reshape(tokens, 1, heads * v.shape[2]), o_proj, threads)[:, 0]


@njit(nogil=True, cache=True)
def mla_attention_residual(x, norm, norm_eps, block, kv, inv_freq, rope_scale, positions, slots, req_to_token, rows,
                           prefix_lens):  # pragma: no cover - compiled
    """x + mla_attention_rows(RMSNorm(x)) for the residual stream x [T, hidden] (norm: the layer's input norm), with
    cos / sin of the tokens' positions from the rotary frequencies (RotaryEmbedding.cos_sin)."""
    angles = positions.astype(np.float32).reshape(-1, 1) * inv_freq.reshape(1, -1)
    cos, sin = np.cos(angles) * rope_scale, np.sin(angles) * rope_scale
    return x + mla_attention_rows(_rms_rows(x, norm, norm_eps), block, kv, cos, sin, slots, req_to_token, rows,
                                  prefix_lens)


@njit(nogil=True, cache=True)
def _rms_rows(x, norm, eps):  # pragma: no cover - compiled
    """RMSNorm (rms_scaled) of each row of x [T, K] into a new array."""
    h = np.empty_like(x)
    for t in range(x.shape[0]):
        rms_scaled(x[t], norm, eps, h[t])
    return h


@njit(nogil=True, cache=True)
def swiglu_rows(x, gate_up, down, threads):  # pragma: no cover - compiled
    """down(SiLU(gate) * up) for x [T, K] through stored matrices (project_rows' w): gate_up stacks gate's rows over
    up's (dense_linear.swiglu_rows decides when this runs)."""
    tokens = x.shape[0]
    both = project_rows(x.reshape(tokens, 1, x.shape[1]), gate_up, threads)
    inter = both.shape[2] // 2
    act = np.empty((tokens, 1, inter), np.float32)
    for t in range(tokens):
        for i in range(inter):
            gate = both[t, 0, i]
            act[t, 0, i] = gate / (np.float32(1.0) + np.exp(-gate)) * both[t, 0, inter + i]
    return project_rows(act, down, threads)[:, 0]


@njit(nogil=True, cache=True)
def moe_block_rows(x, norm, eps, router, bias, route, skip, experts, shared_gate_up, shared_down,
                   threads):  # pragma: no cover - compiled
    """A decode batch's MoE block from the residual stream back to it (moe_block.py: the arguments, and when this
    runs): h = RMSNorm(x), the router on h (router_logits, route_rows), the routed experts (moe_rows_routed) and the
    shared experts (swiglu_rows; none where shared_gate_up has no rows) -> (x + their sum, the chosen ids [T, k],
    missing as moe_rows_routed's: x unchanged where an expert is missing)."""
    h = _rms_rows(x, norm, eps)
    ids, weights = route_rows(router_logits(h, router), bias, route)
    out, missing = moe_rows_routed(h, ids, weights, skip, experts)
    if missing >= 0:
        return x, ids, missing
    if shared_gate_up[0].shape[1]:
        out += swiglu_rows(h, shared_gate_up, shared_down, threads)
    return x + out, ids, missing


@njit(nogil=True, cache=True)
def swiglu_residual(x, norm, eps, gate_up, down, threads):  # pragma: no cover - compiled
    """x + swiglu_rows(RMSNorm(x)) for the residual stream x [T, hidden] (a dense layer's MLP block)."""
    return x + swiglu_rows(_rms_rows(x, norm, eps), gate_up, down, threads)


@njit(nogil=True, cache=True)
def norm_project_rows(x, rows, norm, eps, w, threads):  # pragma: no cover - compiled
    """project_rows(RMSNorm(x[rows])) for x [T, K]: the final norm and a stored lm_head -> [len(rows), N] fp32."""
    picked = np.empty((rows.shape[0], x.shape[1]), np.float32)
    for i in range(rows.shape[0]):
        rms_scaled(x[rows[i]], norm, eps, picked[i])
    return project_rows(picked.reshape(rows.shape[0], 1, x.shape[1]), w, threads)[:, 0]
