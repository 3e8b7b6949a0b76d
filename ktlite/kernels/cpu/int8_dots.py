"""INT4/INT8 rows on int8 activations: integer dot products, one row (`row_dot_q8`) or a VNNI tile of
TILE_ROWS rows x up to TILE_TOKENS tokens (`tile_dot_q8`), and which of them this CPU runs
(`int_dot_path`, `INT_TILES`). The activations are quantized by activations.py; fp32 rows are rowdots.py's.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ktlite.kernels.cpu.rowdots import row_dot
from ktlite.kernels.cpu.simd import (
    B32, B64, D8, F2, F32, F8, I32, I8, LANES, PREFETCH_BYTES, VF, W16, W32, array_args, c64, cvec, hsum, is_vec,
    llvm_call, load_at, prefetch_ahead, splat, vfma, vload,
)
from ktlite.kernels.cpu.target import configure_numba

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


def _pair_sums(builder, v, n):
    """Lanes (2i, 2i + 1) of an n-lane int32 vector added: n / 2 lanes."""
    even = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n // 2), list(range(1, n, 2))))
    return builder.add(even, odd)


def _block_dot(builder, w, x, w_signed):
    """32 weight bytes w (u8, or s8 if w_signed) times 32 activation bytes x (s8) -> 8 fp32 lanes whose sum
    is the block's dot product (exact: integer until the convert)."""
    if int_dot_in_hardware():
        if w_signed:  # vpmaddubsw needs an unsigned side: |w| times x with w's sign
            x = llvm_call(builder, "llvm.x86.avx2.psign.b", B32, [x, w])
            w = llvm_call(builder, "llvm.abs.v32i8", B32, [w, ir.Constant(ir.IntType(1), 0)])
        p16 = llvm_call(builder, "llvm.x86.avx2.pmadd.ub.sw", W16, [w, x])
        p32 = llvm_call(builder, "llvm.x86.avx2.pmadd.wd", D8, [p16, cvec(W16, 1)])
    else:
        v32 = ir.VectorType(I32, 32)
        wide = builder.sext(w, v32) if w_signed else builder.zext(w, v32)
        p32 = _pair_sums(builder, _pair_sums(builder, builder.mul(wide, builder.sext(x, v32)), 32), 16)
    return builder.sitofp(p32, F8)


def _wide_block_dot(builder, w, x, w_signed):
    """64 weight bytes w times 64 activation bytes x (two 32-blocks) with AVX-512BW -> 16 fp32 lanes: lanes
    0-7 sum to the first block's dot product, 8-15 to the second's (exact: integer until the convert)."""
    if w_signed:  # no 512-bit vpsignb: negate x where w < 0 (|x| <= 127, so no overflow), then |w|
        x = builder.select(builder.icmp_signed("<", w, cvec(B64, 0)), builder.sub(cvec(B64, 0), x), x)
        w = llvm_call(builder, "llvm.abs.v64i8", B64, [w, ir.Constant(ir.IntType(1), 0)])
    if int_dot_path() == "avx512-vnni":
        d16 = ir.VectorType(I32, 16)
        p32 = llvm_call(builder, "llvm.x86.avx512.vpdpbusd.512", d16,
                    [cvec(d16, 0), builder.bitcast(w, d16), builder.bitcast(x, d16)])
    else:
        p16 = llvm_call(builder, "llvm.x86.avx512.pmaddubs.w.512", W32, [w, x])
        p32 = llvm_call(builder, "llvm.x86.avx512.pmaddw.d.512", ir.VectorType(I32, 16), [p16, cvec(W32, 1)])
    return builder.sitofp(p32, VF)


def _halves(builder, a, b):
    """16 fp32 lanes: a in lanes 0-7, b in lanes 8-15."""
    two = builder.insert_element(builder.insert_element(ir.Constant(ir.VectorType(F32, 2), ir.Undefined), a,
                                                        ir.Constant(I32, 0)), b, ir.Constant(I32, 1))
    return builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(I32, LANES), [0] * 8 + [1] * 8))


def _int_row_dot(w_signed):
    """row . x for an INT8 (w_signed) or INT4 row from int8 activations (xq, xd; xo: INT4's offset term
    8 xd[b] sum_b xq, so sum (q - 8) s x = sum s xd (q . xq) - sum s xo)."""

    def typer(typingctx, q, s, xq, xd, xo, gs):
        if not (is_vec(q, types.int8 if w_signed else types.uint8) and is_vec(s, types.float32)
                and is_vec(xq, types.int8) and is_vec(xd, types.float32) and is_vec(xo, types.float32)):
            return None
        sig = types.float32(q, s, xq, xd, xo, types.int64)
        wide = int_dot_path().startswith("avx512")
        acc_ty = VF if wide else F8

        def codegen(context, builder, sig, args):
            (qp, nb), (sp, _), (xqp, _), (xdp, _), (xop, _) = array_args(context, builder, sig, args, 5)
            gs = args[5]
            accs = [cgutils.alloca_once_value(builder, cvec(acc_ty, 0.0)) for _ in range(2)]
            off = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))

            def block_scale(blk):  # (weight scale, weight scale x activation scale) of 32-block blk
                sc = load_at(builder, sp, builder.lshr(builder.shl(blk, c64(5)), gs))
                if not w_signed:
                    builder.store(builder.fma(sc, load_at(builder, xop, blk), builder.load(off)), off)
                return builder.fmul(sc, load_at(builder, xdp, blk))

            def add_block(w, blk, acc):  # 32 weights of block blk
                f = _block_dot(builder, w, vload(builder, xqp, builder.shl(blk, c64(5)), B32), w_signed)
                builder.store(vfma(builder, f, splat(builder, block_scale(blk), F8), builder.load(acc)), acc)

            off2 = cgutils.alloca_once_value(builder, cvec(F2, 0.0))  # the offset term's shared-scale part

            def pair_scales(blk):  # 16 lanes: weight scale x xd of block blk (lanes 0-7) and blk + 1 (8-15)
                return _halves(builder, block_scale(blk), block_scale(builder.add(blk, c64(1))))

            def shared_pair_scales(blk):  # the same where both blocks are in one group (groups >= 64): one scale
                # load and vector work in place of two scalar chains (INT4 decode was bound by them, not by memory)
                sc = load_at(builder, sp, builder.lshr(builder.shl(blk, c64(5)), gs))
                if not w_signed:
                    xo = vload(builder, xop, blk, F2)
                    builder.store(vfma(builder, splat(builder, sc, F2), xo, builder.load(off2)), off2)
                xd = vload(builder, xdp, blk, F2)
                lanes = builder.shuffle_vector(xd, xd, ir.Constant(ir.VectorType(I32, LANES), [0] * 8 + [1] * 8))
                return builder.fmul(splat(builder, sc), lanes)

            def add_pair(w, blk, acc, scales):  # 64 weights of blocks blk, blk + 1
                f = _wide_block_dot(builder, w, vload(builder, xqp, builder.shl(blk, c64(5)), B64), w_signed)
                builder.store(vfma(builder, f, scales(blk), builder.load(acc)), acc)

            def row_loop(scales):
                with cgutils.for_range(builder, builder.lshr(nb, c64(6))) as loop:  # 64 bytes a step
                    c = loop.index
                    b0 = builder.shl(c, c64(6))
                    prefetch_ahead(builder, qp, b0)
                    # and the scales of the weights as far ahead (the hardware prefetchers alone fall behind)
                    ahead = builder.add(b0, c64(PREFETCH_BYTES))
                    group = builder.lshr(ahead if w_signed else builder.shl(ahead, c64(1)), gs)
                    prefetch_ahead(builder, builder.bitcast(sp, I8.as_pointer()), builder.shl(group, c64(2)), 0)
                    if wide:  # INT8: blocks 2c, 2c + 1; INT4: low nibbles 4c, 4c + 1, high nibbles 4c + 2, 4c + 3
                        raw = vload(builder, qp, b0, B64)
                        if w_signed:
                            add_pair(raw, builder.shl(c, c64(1)), accs[0], scales)
                        else:
                            c4 = builder.shl(c, c64(2))
                            add_pair(builder.and_(raw, cvec(B64, 15)), c4, accs[0], scales)
                            add_pair(builder.lshr(raw, cvec(B64, 4)), builder.add(c4, c64(2)), accs[1], scales)
                    else:
                        for h in range(2):  # 32 bytes a half
                            raw = vload(builder, qp, builder.add(b0, c64(32 * h)), B32)
                            if w_signed:
                                add_block(raw, builder.add(builder.shl(c, c64(1)), c64(h)), accs[h])
                            else:
                                c4 = builder.shl(c, c64(2))
                                add_block(builder.and_(raw, cvec(B32, 15)), builder.add(c4, c64(h)), accs[0])
                                add_block(builder.lshr(raw, cvec(B32, 4)), builder.add(c4, c64(2 + h)), accs[1])

            if wide:
                with builder.if_else(builder.icmp_signed(">=", gs, c64(6))) as (shared, per_block):
                    with shared:
                        row_loop(shared_pair_scales)
                    with per_block:
                        row_loop(pair_scales)
            else:
                row_loop(None)
            tot = hsum(builder, builder.fadd(builder.load(accs[0]), builder.load(accs[1])))
            if w_signed:
                return tot
            o2 = builder.load(off2)  # INT4's offset term: per-block part in off, shared-scale part in off2
            extra = builder.fadd(builder.extract_element(o2, ir.Constant(I32, 0)),
                                 builder.extract_element(o2, ir.Constant(I32, 1)))
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
                and is_vec(tix, types.int64)):
            return None
        sig = types.void(q, s, types.int64, xq, xd, tix, types.int64, out)

        def codegen(context, builder, sig, args):
            arrs = [context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3, 4, 5, 7)]
            (qa, sa, xqa, xda, tixa, outa) = arrs
            n_rows, nb = cgutils.unpack_tuple(builder, qa.shape)
            n_groups = cgutils.unpack_tuple(builder, sa.shape)[1]
            kp = cgutils.unpack_tuple(builder, xqa.shape)[1]
            n_blocks = cgutils.unpack_tuple(builder, xda.shape)[1]
            last = builder.sub(n_rows, c64(1))
            rows = []
            for i in range(TILE_ROWS):
                r = builder.add(args[2], c64(i))
                r = builder.select(builder.icmp_signed(">", r, last), last, r)
                rows.append((builder.gep(qa.data, [builder.mul(r, nb)], inbounds=True),
                             builder.gep(sa.data, [builder.mul(r, n_groups)], inbounds=True)))
            toks = []
            for j in range(n_tokens):
                t = load_at(builder, tixa.data, c64(j))
                toks.append((builder.gep(xqa.data, [builder.mul(t, kp)], inbounds=True),
                             builder.gep(xda.data, [builder.mul(t, n_blocks)], inbounds=True)))
            accs = [[cgutils.alloca_once_value(builder, cvec(VF, 0.0)) for _ in range(n_tokens)]
                    for _ in range(TILE_ROWS)]
            d16 = ir.VectorType(I32, 16)
            bias = cvec(B64, -128)  # 0x80 bytes: vpdpbusd reads them as unsigned 128

            def dpbusd(acc, unsigned, signed):
                return llvm_call(builder, "llvm.x86.avx512.vpdpbusd.512", d16,
                             [acc, builder.bitcast(unsigned, d16), builder.bitcast(signed, d16)])

            def piece(ws, k, blk):  # signed weights ws[i] (64 each) against tokens' bytes k.., blocks blk, blk + 1
                xs = []
                for xqp, xdp in toks:
                    xu = builder.xor(vload(builder, xqp, k, B64), bias)
                    xs.append((xu, _halves(builder, load_at(builder, xdp, blk),
                                           load_at(builder, xdp, builder.add(blk, c64(1))))))
                g0 = builder.lshr(builder.shl(blk, c64(5)), args[6])
                g1 = builder.lshr(builder.shl(builder.add(blk, c64(1)), c64(5)), args[6])
                for (qp, sp), w, row_accs in zip(rows, ws, accs):
                    neg = dpbusd(cvec(d16, 0), bias, builder.sub(cvec(B64, 0), w))  # -128 * sum w per 4 bytes
                    wsh = _halves(builder, load_at(builder, sp, g0), load_at(builder, sp, g1))
                    for (xu, xdh), acc in zip(xs, row_accs):
                        f = builder.sitofp(dpbusd(neg, xu, w), VF)
                        builder.store(vfma(builder, f, builder.fmul(wsh, xdh), builder.load(acc)), acc)

            with cgutils.for_range(builder, builder.lshr(nb, c64(6))) as loop:  # 64 stored bytes a step
                c = loop.index
                b0 = builder.shl(c, c64(6))
                raws = []
                for qp, _ in rows:
                    prefetch_ahead(builder, qp, b0)
                    raws.append(vload(builder, qp, b0, B64))
                if w_signed:
                    piece(raws, b0, builder.shl(c, c64(1)))
                else:  # low nibbles: weights 128c.., blocks 4c, 4c + 1; high nibbles: 128c + 64.., 4c + 2, 4c + 3
                    eight = cvec(B64, 8)
                    k0 = builder.shl(c, c64(7))
                    c4 = builder.shl(c, c64(2))
                    piece([builder.sub(builder.and_(w, cvec(B64, 15)), eight) for w in raws], k0, c4)
                    piece([builder.sub(builder.lshr(w, cvec(B64, 4)), eight) for w in raws],
                          builder.add(k0, c64(64)), builder.add(c4, c64(2)))
            n_tok_cols = cgutils.unpack_tuple(builder, outa.shape)[1]
            for i, row_accs in enumerate(accs):
                for j, acc in enumerate(row_accs):
                    dst = builder.add(builder.mul(c64(i), n_tok_cols), c64(j))
                    builder.store(hsum(builder, builder.load(acc)), builder.gep(outa.data, [dst], inbounds=True))
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
        # typed in kernels whose tile branch runs_as_tiles rules out for q (BF16, FP8, GGUF rows): a no-op, not a raise,
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


# with INT_TILES an expert with this many tokens or more runs as tiles (one token: the row dot, as fast)
TILE_MIN_TOKENS = 2
INT_TILES = int_tiles_in_hardware()


def _int_rows(q):  # pragma: no cover - replaced in jit code
    raise NotImplementedError("_int_rows is only callable from numba-compiled code")


@overload(_int_rows, inline="always")
def _int_rows_impl(q):
    """Whether stored matrices q hold INT4/INT8 rows (a constant of q's type)."""
    answer = q.dtype in (types.uint8, types.int8)
    return lambda q: answer


@njit(nogil=True, cache=True, inline="always")
def runs_as_tiles(q8, q, n_tokens):
    """Whether n_tokens int8-activation dots against the rows of stored matrices q run as tiles (INT4/INT8 rows)."""
    return INT_TILES and q8 and _int_rows(q) and n_tokens >= TILE_MIN_TOKENS


@njit(nogil=True, cache=True, inline="always")
def gate_up_tiles(q, s, r_lo, r_hi, xq, xd, tok_idx, p_lo, p_hi, group_shift, tiles, act):
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
