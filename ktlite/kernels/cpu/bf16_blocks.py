"""bf16 block products for the CPU attention's extends (gqa_attention.attend_bf16_tiles): C (32 x 32 fp32) += A
(32 rows of bf16) x B (bf16 in the VNNI layout: each row a pair of consecutive k, one 32-bit word per column), in
one of two instruction sets, chosen per call by `kind`:

- AMX_BF16_TILES (Sapphire Rapids on): 2 x 2 tiles of tdpbf16ps (_bf16_tile_block), each tile loaded once a step of
  32 k for two multiplies.
- AVX512_BF16_DOTS (Zen 4 / 5, Cooper Lake, and Intel's AMX CPUs too): vdpbf16ps, one fp32 lane += a pair of
  products (_bf16_dot_block): 8 rows x 32 columns of sums in 16 zmm registers, B's two vectors of a k pair loaded
  once for the 8 rows, each row's pair of A broadcast.

Both are compiled where the target has them (an AMX CPU's tests run both); an instruction set the compile target
lacks emits nothing, so callers take a kind from `products_available()`, and `BF16_PRODUCTS` is the fastest one
here (FP32_PRODUCTS where there is none: the callers' fp32 path). Between the scores and P @ V runs the online softmax,
`bf16_probabilities`, in 16-lane vectors; `interleave_rows` puts two keys' values into one VNNI row.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ktlite.kernels.cpu.amx_tiles import TMM_W, TMM_X, tile_config, tile_op
from ktlite.kernels.cpu.simd import (
    F32, I32, I64, I8, LANES, V16, VF, W32, c64, cvec, dpbf16ps, exp2_fast, hsum, is_vec, load_at, round_bf16, splat,
    vfma, vload, vmax, vmax_lanes, vstore,
)
from ktlite.kernels.cpu.target import amx_permitted, configure_numba

FP32_PRODUCTS, AVX512_BF16_DOTS, AMX_BF16_TILES = 0, 1, 2  # how an extend's products run (a kernel argument)
DOT_ROWS = 8  # rows of A per register block of _bf16_dot_block: 8 x 2 vectors of sums, 2 of B, 1 broadcast
_WORDS = ir.VectorType(I32, LANES)  # 16 words of two bf16 each: one k pair of 16 columns


def products_available() -> tuple[int, ...]:
    """The kinds of products this process can run: fp32 always; AVX512-BF16 dots where the compile target has
    them; AMX-BF16 tiles where it has them and the OS granted the tile state."""
    target = configure_numba()
    return ((FP32_PRODUCTS,) + ((AVX512_BF16_DOTS,) if target.enabled("avx512bf16") else ())
            + ((AMX_BF16_TILES,) if target.enabled("amx-bf16") and amx_permitted() else ()))


def _bf16_tile_args(q, kt, out) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == d
               for a, d in ((q, types.uint16), (kt, types.uint16), (out, types.float32)))


def _byte_rows(context, builder, ty, val, row0, col0):
    """(address of element [row0, col0] as bytes, row stride in bytes) of a 2-D C-contiguous array."""
    arr = context.make_array(ty)(context, builder, val)
    item = context.get_abi_sizeof(context.get_data_type(ty.dtype))
    stride = builder.mul(cgutils.unpack_tuple(builder, arr.shape)[1], c64(item))
    at = builder.add(builder.mul(row0, stride), builder.mul(col0, c64(item)))
    return builder.gep(builder.bitcast(arr.data, I8.as_pointer()), [at], inbounds=True), stride


def _bf16_tile_block(builder, a_rows, a_stride, b_rows, b_stride, c_rows, c_stride, steps, load_sums) -> None:
    """C (2 x 2 tiles of 16 x 16 fp32 at c_rows: rows 16 i, columns 16 j) += A (two tiles of 16 rows x 32 bf16, the
    step's 64 bytes of each row at a_rows + 16 i rows) x B (two VNNI tiles: 16 rows of value pairs, 16 columns, at
    b_rows + 64 j bytes) for each 64-byte step of A, B's rows 16 a step: tmm0-3 the sums (loaded from C, or zero),
    tmm4/5 A, tmm6/7 B, each tile loaded once a step for two multiplies."""
    tile_config(builder)
    for i in range(2):
        for j in range(2):
            at = builder.gep(c_rows, [builder.add(builder.mul(c64(16 * i), c_stride), c64(64 * j))])
            if load_sums:
                tile_op(builder, "tileloadd64", 2 * i + j, at, c_stride)
            else:
                tile_op(builder, "tilezero", 2 * i + j)
    with cgutils.for_range(builder, steps) as loop:
        for i in range(2):
            a_at = builder.add(builder.mul(c64(16 * i), a_stride), builder.shl(loop.index, c64(6)))
            tile_op(builder, "tileloadd64", TMM_W + i, builder.gep(a_rows, [a_at]), a_stride)
        for j in range(2):
            b_at = builder.add(builder.mul(builder.shl(loop.index, c64(4)), b_stride), c64(64 * j))
            tile_op(builder, "tileloadd64", TMM_X + j, builder.gep(b_rows, [b_at]), b_stride)
        for i in range(2):
            for j in range(2):
                tile_op(builder, "tdpbf16ps", 2 * i + j, TMM_W + i, TMM_X + j)
    for i in range(2):
        for j in range(2):
            at = builder.gep(c_rows, [builder.add(builder.mul(c64(16 * i), c_stride), c64(64 * j))])
            tile_op(builder, "tilestored64", 2 * i + j, at, c_stride)
    tile_op(builder, "tilerelease")


def _bf16_dot_block(builder, a_rows, a_stride, b_rows, b_stride, c_rows, c_stride, steps, load_sums) -> None:
    """_bf16_tile_block's product in AVX512-BF16 vectors: per DOT_ROWS rows of A, 2 x DOT_ROWS vectors of sums
    (loaded from C, or zero) in registers over the steps' 16 k pairs each: B's two 16-column word vectors of a
    pair loaded once, the row's pair of A (one word) broadcast, one vdpbf16ps per row and vector."""
    for i0 in range(0, 32, DOT_ROWS):
        sums = [[cgutils.alloca_once(builder, VF) for _ in range(2)] for _ in range(DOT_ROWS)]  # registers (mem2reg)
        c_at = [[builder.add(builder.mul(c64(i0 + i), c_stride), c64(64 * j)) for j in range(2)]
                for i in range(DOT_ROWS)]
        for i in range(DOT_ROWS):
            for j in range(2):
                builder.store(vload(builder, c_rows, c_at[i][j], VF) if load_sums else cvec(VF, 0.0), sums[i][j])
        a_row = [builder.bitcast(builder.gep(a_rows, [builder.mul(c64(i0 + i), a_stride)]), I32.as_pointer())
                 for i in range(DOT_ROWS)]
        with cgutils.for_range(builder, builder.shl(steps, c64(4))) as loop:
            b = [vload(builder, b_rows, builder.add(builder.mul(loop.index, b_stride), c64(64 * j)), _WORDS)
                 for j in range(2)]
            for i in range(DOT_ROWS):
                a = splat(builder, builder.load(builder.gep(a_row[i], [loop.index], inbounds=True), align=4), _WORDS)
                for j in range(2):
                    builder.store(dpbf16ps(builder, builder.load(sums[i][j]), a, b[j]), sums[i][j])
        for i in range(DOT_ROWS):
            for j in range(2):
                vstore(builder, builder.load(sums[i][j]), c_rows, c_at[i][j])


def _bf16_block(builder, kind, a, b, c, steps, load_sums) -> None:
    """C += A x B (a, b, c: (address, row stride) in bytes) by `kind` (an i64): tiles or dots, whichever the
    compile target has, and where it has both the one kind asks for."""
    target = configure_numba()
    tiles, dots = target.enabled("amx-bf16"), target.enabled("avx512bf16")
    if tiles and dots:
        with builder.if_else(builder.icmp_signed("==", kind, c64(AMX_BF16_TILES))) as (on_tiles, on_dots):
            with on_tiles:
                _bf16_tile_block(builder, *a, *b, *c, steps, load_sums)
            with on_dots:
                _bf16_dot_block(builder, *a, *b, *c, steps, load_sums)
    elif tiles or dots:
        (_bf16_tile_block if tiles else _bf16_dot_block)(builder, *a, *b, *c, steps, load_sums)


@intrinsic
def bf16_block_scores(typingctx, q, r0, kt, c0, steps, st, kind):
    """st[i, c0 + c] = q[r0 + i] . key c0 + c for i, c < 32, over 32 steps dims: q [rows, 32 steps] bf16 bits, kt
    [dims / 2, 2 KB] the keys in the VNNI layout (row d holds dims 2d, 2d + 1 of every key, key c at columns 2c,
    2c + 1), st [32, KB] fp32; kind AMX_BF16_TILES or AVX512_BF16_DOTS (_bf16_block)."""
    if not _bf16_tile_args(q, kt, st):
        return None
    sig = types.void(q, types.int64, kt, types.int64, types.int64, st, types.int64)

    def codegen(context, builder, sig, args):
        a = _byte_rows(context, builder, sig.args[0], args[0], args[1], c64(0))
        b = _byte_rows(context, builder, sig.args[2], args[2], c64(0), builder.shl(args[3], c64(1)))
        c = _byte_rows(context, builder, sig.args[5], args[5], c64(0), args[3])
        _bf16_block(builder, args[6], a, b, c, args[4], False)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bf16_block_values(typingctx, p, vv, c0, steps, o, r0, kind):
    """o[r0 + i, c0 + e] += sum over keys k < 32 steps of p[i, k] * value e of key k, for i, e < 32: p [32, KB] the
    probabilities as bf16 bits, vv [KB / 2, 2 Dv] the values in the VNNI layout (row k holds keys 2k, 2k + 1: dim e
    at columns 2e, 2e + 1), o [rows, Dv] fp32; kind as bf16_block_scores'."""
    if not _bf16_tile_args(p, vv, o):
        return None
    sig = types.void(p, vv, types.int64, types.int64, o, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        a = _byte_rows(context, builder, sig.args[0], args[0], c64(0), c64(0))
        b = _byte_rows(context, builder, sig.args[1], args[1], c64(0), builder.shl(args[2], c64(1)))
        c = _byte_rows(context, builder, sig.args[4], args[4], args[5], args[2])
        _bf16_block(builder, args[6], a, b, c, args[3], True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bf16_probabilities(typingctx, st, pb, o, r0, n, lo, hi, width, scale2, m, s_sum):
    """The online-softmax step of up to 32 rows over one block of scores (amx_bf16_scores' st [32, KB]): row i < n
    (row r0 + i of o, m, s_sum) sees the block's keys lo[i] <= c < hi[i] of the first `width` (a multiple of 16);
    its scores times scale2 (> 0; log2 units) give its new max, the factor alpha = 2^(old max - new max) by which
    its exp-sum and its output row o[r0 + i] are rescaled, and its probabilities 2^(scaled score - max), whose sum
    joins s_sum and whose bf16 bits (round_bf16) go to pb[i, :width] (zeros outside lo..hi, and for rows i >= n or
    rows that see none of the block). Per row one pass of 16-lane vectors for the max of the raw scores (scale2 > 0
    keeps the order) and one for the exponentials (one FMA scales and shifts a score; exp2_fast); lanes are masked
    only in rows that do not see the whole width. numba's loops around simd.row_max / exp2_sum spent ~6 cycles a
    score on slicing and scalar exp2."""
    arrays = ((st, types.float32, 2), (pb, types.uint16, 2), (o, types.float32, 2), (lo, types.int64, 1),
              (hi, types.int64, 1), (m, types.float32, 1), (s_sum, types.float32, 1))
    if not all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == d and a.ndim == k for a, d, k in arrays):
        return None
    sig = types.void(st, pb, o, types.int64, types.int64, lo, hi, types.int64, types.float32, m, s_sum)

    def codegen(context, builder, sig, args):
        sa, pa, oa, loa, hia, ma, suma = (context.make_array(sig.args[i])(context, builder, args[i])
                                          for i in (0, 1, 2, 5, 6, 9, 10))
        r0, n, width, scale = args[3], args[4], args[7], args[8]
        kb = cgutils.unpack_tuple(builder, sa.shape)[1]
        dv = cgutils.unpack_tuple(builder, oa.shape)[1]
        chunks = builder.lshr(width, c64(4))
        lanes_ty = ir.VectorType(I64, LANES)
        lane_ids = ir.Constant(lanes_ty, list(range(LANES)))
        none = cvec(VF, -1e30)

        def row_pass(srow, lo_i, hi_i, masked: bool, body):  # body(chunk offset, scores, lanes seen or None)
            with cgutils.for_range(builder, chunks) as loop:
                c = builder.shl(loop.index, c64(4))
                seen = None
                if masked:
                    idx = builder.add(lane_ids, splat(builder, c, lanes_ty))
                    seen = builder.and_(builder.icmp_signed(">=", idx, splat(builder, lo_i, lanes_ty)),
                                        builder.icmp_signed("<", idx, splat(builder, hi_i, lanes_ty)))
                body(c, vload(builder, sa.data, builder.add(srow, c), VF), seen)

        def softmax_row(i, srow, lo_i, hi_i, masked: bool):
            r = builder.add(r0, i)
            top = cgutils.alloca_once_value(builder, none)

            def max_of(c, v, seen):
                builder.store(vmax(builder, builder.load(top), v if seen is None else builder.select(seen, v, none)),
                              top)

            row_pass(srow, lo_i, hi_i, masked, max_of)
            old = load_at(builder, ma.data, r)
            new = vmax(builder, old, builder.fmul(vmax_lanes(builder, builder.load(top)), scale))
            alpha = builder.extract_element(exp2_fast(builder, splat(builder, builder.fsub(old, new))),
                                            ir.Constant(I32, 0))
            total = cgutils.alloca_once_value(builder, cvec(VF, 0.0))
            scale_v, shift = splat(builder, scale), splat(builder, builder.fneg(new))

            def probabilities(c, v, seen):
                p = exp2_fast(builder, vfma(builder, v, scale_v, shift))
                if seen is not None:
                    p = builder.select(seen, p, cvec(VF, 0.0))
                builder.store(builder.fadd(builder.load(total), p), total)
                vstore(builder, round_bf16(builder, p, flush_denormals=True), pa.data, builder.add(srow, c))

            row_pass(srow, lo_i, hi_i, masked, probabilities)
            s_at = builder.gep(suma.data, [r], inbounds=True)
            builder.store(builder.fadd(builder.fmul(builder.load(s_at), alpha), hsum(builder, builder.load(total))),
                          s_at)
            builder.store(new, builder.gep(ma.data, [r], inbounds=True))
            with builder.if_then(builder.fcmp_ordered("!=", alpha, ir.Constant(F32, 1.0))):
                a_v, orow = splat(builder, alpha), builder.mul(r, dv)
                with cgutils.for_range(builder, builder.lshr(dv, c64(4))) as loop:
                    at = builder.add(orow, builder.shl(loop.index, c64(4)))
                    vstore(builder, builder.fmul(vload(builder, oa.data, at, VF), a_v), oa.data, at)

        with cgutils.for_range(builder, c64(32)) as rows:
            i = rows.index
            srow = builder.mul(i, kb)  # the row's offset in st and in pb (same shape)
            lo_i, hi_i = load_at(builder, loa.data, i), load_at(builder, hia.data, i)
            live = builder.and_(builder.icmp_signed("<", i, n), builder.icmp_signed("<", lo_i, hi_i))
            whole = builder.and_(builder.icmp_signed("<=", lo_i, c64(0)), builder.icmp_signed(">=", hi_i, width))
            with builder.if_else(live) as (sees, blank):
                with blank:
                    with cgutils.for_range(builder, chunks) as loop:
                        vstore(builder, cvec(V16, 0), pa.data, builder.add(srow, builder.shl(loop.index, c64(4))))
                with sees:
                    with builder.if_else(whole) as (full, part):
                        with full:
                            softmax_row(i, srow, lo_i, hi_i, False)
                        with part:
                            softmax_row(i, srow, lo_i, hi_i, True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def interleave_rows(typingctx, a, b, out, n):
    """out[2 e] = a[e], out[2 e + 1] = b[e] for e < n (a multiple of 32; uint16, 1-D C-contiguous): two keys' value
    rows as one row of AMX's VNNI layout for P @ V."""
    if not (is_vec(a, types.uint16) and is_vec(b, types.uint16) and is_vec(out, types.uint16)):
        return None
    sig = types.void(a, b, out, types.int64)
    pairs = ir.Constant(ir.VectorType(I32, 64), [k // 2 + 32 * (k % 2) for k in range(64)])

    def codegen(context, builder, sig, args):
        ap, bp, op = (context.make_array(t)(context, builder, v).data for t, v in zip(sig.args[:3], args[:3]))
        with cgutils.for_range(builder, builder.lshr(args[3], c64(5))) as loop:
            e = builder.shl(loop.index, c64(5))
            va, vb = vload(builder, ap, e, W32), vload(builder, bp, e, W32)
            vstore(builder, builder.shuffle_vector(va, vb, pairs), op, builder.shl(e, c64(1)))
        return context.get_dummy_value()

    return sig, codegen


BF16_PRODUCTS = max(products_available())  # the kinds are numbered slowest first
