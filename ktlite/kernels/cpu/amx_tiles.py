"""The AMX tile machinery (CPUs with AMX-INT8): `amx_block_dot` / `amx_folded_block_dot`, numba intrinsics that
configure the tiles and multiply blocks of 32 weight rows by tiles of 16 tokens' int8 activations, the vector
helpers that turn the tiles' sums into rows (`transpose_sums`, `tile_into_rows`), and `AMX`: whether this process
may run them (target.amx_permitted). The kernels that drive them (moe_amx, linear_amx) are amx_kernels.py.
For attention on AMX-BF16 (gqa_attention.attend_bf16_tiles): `amx_bf16_scores` / `amx_bf16_values` (2 x 2 tiles of
fp32 sums from bf16 operands in the same 16 x 64-byte tile shapes), `bf16_probabilities` (the online softmax between
them, in vectors) and `interleave_rows` (two keys' values as one VNNI row); `AMX_BF16` says whether they run.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ktlite.kernels.cpu.quantizer import INT4_MULTIPLES
from ktlite.kernels.cpu.simd import (
    B64, F32, I16, I32, I64, I8, LANES, V16, V32, VF, W32, c64, cvec, exp2_fast, hsum, is_vec, llvm_call, load_at,
    prefetch_ahead, round_bf16, splat, vfma, vload, vmax, vmax_lanes, vstore,
)
from ktlite.kernels.cpu.target import amx_permitted, configure_numba

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
    llvm_call(builder, f"llvm.x86.{name}", ir.VoidType(), [ir.Constant(I8, a) if isinstance(a, int) else a for a in args])


def _tile_buffer(builder, size):
    """A stack buffer of size bytes for tile loads / stores: 64-byte aligned (a tile row that crosses a cache line
    splits the load: 6x slower tile loads on Sapphire Rapids)."""
    buf = cgutils.alloca_once(builder, ir.ArrayType(I8, size))
    buf.align = 64
    return buf


def _tile_config(builder):
    """ldtilecfg for tmm0-7, each 16 rows x 64 bytes (int32 sums of 16 x 16, or 16 x 64 int8 operands)."""
    cfg = cgutils.alloca_once(builder, ir.ArrayType(I8, 64))
    cfg.align = 64
    ptr = builder.bitcast(cfg, I8.as_pointer())
    builder.store(ir.Constant(ir.ArrayType(I8, 64), [1] + [0] * 63), cfg)  # palette 1, start row 0
    for t in range(8):
        builder.store(ir.Constant(I16, 64), builder.bitcast(builder.gep(ptr, [c64(16 + 2 * t)]), I16.as_pointer()))
        builder.store(ir.Constant(I8, AMX_ROWS), builder.gep(ptr, [c64(48 + t)]))
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
        tile_bytes = builder.mul(cgutils.unpack_tuple(builder, xba.shape)[1], c64(64))
        self.qbase = builder.bitcast(builder.gep(qa.data, [builder.mul(r0, self.nb)], inbounds=True), I8.as_pointer())
        self.row_scales = [builder.gep(sa.data, [builder.mul(builder.add(r0, c64(i)), n_groups)])
                           for i in range(AMX_BLOCK_ROWS)]
        tiles = [builder.add(t0, c64(j)) for j in range(n_tiles)]
        self.used = [builder.icmp_signed(">", nt, c64(j)) for j in range(n_tiles)]
        self.x = [builder.bitcast(builder.gep(xba.data, [builder.mul(t, tile_bytes)]), I8.as_pointer()) for t in tiles]
        self.xd = [builder.gep(xdba.data, [builder.mul(t, builder.mul(n_groups, c64(AMX_ROWS)))]) for t in tiles]
        self.last = builder.sub(builder.shl(c64(1), self.gs), c64(64))  # k & (group - 1) of a group's last 64

    def group_ends(self, builder, k):
        """Whether weights k..k + 63 are their group's last."""
        return builder.icmp_unsigned("==", builder.and_(k, builder.add(self.last, c64(63))), self.last)


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
            with builder.if_else(builder.icmp_signed(">=", a.gs, c64(INT8_TILES_GROUP_SHIFT))) as (long, short):
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
        table = cgutils.global_constant(builder.module, name, ir.Constant(ir.ArrayType(I8, len(values)), values))
        table.align = 16
    return builder.bitcast(table, I8.as_pointer())


def _times_m(builder, tables, m, nibbles):
    """(nibbles - 8) x m for 64 nibbles (bytes 0..15) and one multiple m (i8): its table in each 16-byte lane."""
    at = builder.mul(builder.add(builder.sext(m, I64), c64(INT4_MULTIPLES)), c64(16))
    lane = builder.load(builder.bitcast(builder.gep(tables, [at]), ir.VectorType(I8, 16).as_pointer()), align=1)
    table = builder.shuffle_vector(lane, ir.Constant(ir.VectorType(I8, 16), None),
                                   ir.Constant(ir.VectorType(I32, 64), [n % 16 for n in range(64)]))
    return llvm_call(builder, "llvm.x86.avx512.pshuf.b.512", B64, [table, nibbles])


def _unpack_int4(builder, a: _BlockArgs, rows: range, step, unpacked, decode):
    """Rows `rows` of the block, 64 stored bytes each (128 weights: low nibbles weights 0-63 of the step, high nibbles
    64-127, quant.py) into unpacked (128 bytes a row, the low half first) as decode(row, half, nibbles) gives them."""
    b0 = builder.shl(step, c64(6))
    for n, i in enumerate(rows):
        w = vload(builder, a.qbase, builder.add(b0, builder.mul(c64(i), a.nb)), B64)
        for half, nibbles in enumerate((builder.and_(w, cvec(B64, 15)), builder.lshr(w, cvec(B64, 4)))):
            vstore(builder, decode(i, half, nibbles), unpacked, c64(128 * n + 64 * half))


def _int4_block_dot(builder, a: _BlockArgs):
    """32 INT4 rows (two weight tiles, unpacked to signed bytes on the stack a 64-byte step at a time) x up to two
    activation tiles: four tiles of sums, one tile load per multiply; after each group the sums are stored and
    scaled into out."""
    bp = I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, 4 * AMX_ROWS * 64), bp)
    unpacked = builder.bitcast(_tile_buffer(builder, AMX_BLOCK_ROWS * 128), bp)
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            op = builder.gep(a.outa.data, [c64(j * AMX_BLOCK_ROWS * AMX_ROWS)])
            for i in range(AMX_BLOCK_ROWS):
                vstore(builder, cvec(VF, 0.0), op, c64(16 * i))
    _tile_config(builder)
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            _tile_op(builder, "tilezero", 2 * j)
            _tile_op(builder, "tilezero", 2 * j + 1)

    def flush(g):  # the sums of group g, scaled, into out; sums zeroed
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                for w in range(2):
                    _tile_op(builder, "tilestored64", 2 * j + w, builder.gep(sums, [c64(1024 * (2 * j + w))]),
                             c64(64))
                    _tile_op(builder, "tilezero", 2 * j + w)

        def scale(n_tiles):  # rows outer: one weight-scale broadcast live at a time (all 32 at once spilled)
            xds = [vload(builder, xdp, builder.shl(g, c64(4)), VF) for xdp in a.xd[:n_tiles]]
            for i in range(AMX_BLOCK_ROWS):  # sums tile 2 j + i // 16: row i at byte 2048 j + 64 i
                w = splat(builder, load_at(builder, a.row_scales[i], g))
                for j, xd in enumerate(xds):
                    c = vload(builder, sums, c64(2048 * j + 64 * i), V32)
                    op = builder.gep(a.outa.data, [c64(j * AMX_BLOCK_ROWS * AMX_ROWS + 16 * i)])
                    vstore(builder, vfma(builder, builder.sitofp(c, VF), builder.fmul(w, xd),
                                           vload(builder, op, c64(0), VF)), op, c64(0))

        with builder.if_else(a.used[1]) as (two, one):
            with two:
                scale(2)
            with one:
                scale(1)

    def step(weights, k):  # weight tiles at weights[0], weights[1] (weights k..k + 63) x activation tiles
        for w, wp in enumerate(weights):
            _tile_op(builder, "tileloadd64", _TMM_W + w, wp, c64(128))
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                _tile_op(builder, "tileloadd64", _TMM_X + j, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                for w in range(2):
                    _tile_op(builder, "tdpbssd", 2 * j + w, _TMM_W + w, _TMM_X + j)
        with builder.if_then(a.group_ends(builder, k)):
            flush(builder.lshr(k, a.gs))

    with cgutils.for_range(builder, builder.lshr(a.nb, c64(6))) as loop:  # 64 stored bytes of each row a step
        # the block 32 rows on (contiguous, the next call but one for gate/up) read in order: 32 lines a step
        ahead = builder.add(builder.mul(c64(AMX_BLOCK_ROWS), a.nb), builder.shl(loop.index, c64(11)))
        for i in range(AMX_BLOCK_ROWS):
            prefetch_ahead(builder, a.qbase, ahead, 64 * i)
        eight = cvec(B64, 8)
        _unpack_int4(builder, a, range(AMX_BLOCK_ROWS), loop.index, unpacked, lambda i, half, v: builder.sub(v, eight))
        k0 = builder.shl(loop.index, c64(7))
        for half in range(2):
            step([builder.gep(unpacked, [c64(64 * half + 128 * AMX_ROWS * w)]) for w in range(2)],
                 builder.add(k0, c64(64 * half)))
    _tile_op(builder, "tilerelease")


def _int4_folded_dot(builder, a: _BlockArgs, multiples):
    """32 INT4 rows whose scales fold (amx_folded_block_dot), one weight tile of 16 at a time over the whole row x up
    to FOLDED_TOKEN_TILES activation tiles: each 64-byte step of the 16 rows unpacked once (code x m, a vpshufb table
    per row and group) for all of them, the int32 sums in tmm0-3 until the row ends, then scaled once into out."""
    bp = I8.as_pointer()
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
            g = builder.lshr(builder.add(k0, c64(64 * half)), a.gs)
            return _times_m(builder, tables, load_at(builder, multiples.data, builder.add(builder.mul(c64(i), n_groups),
                                                                                          g)), nibbles)

        with cgutils.for_range(builder, builder.lshr(a.nb, c64(6))) as loop:  # 64 stored bytes of each row a step
            k0 = builder.shl(loop.index, c64(7))
            # the next 16 rows (the other weight tile, then the next block) read in the same order: 16 lines a step
            ahead = builder.add(builder.mul(c64(AMX_ROWS * (w + 1)), a.nb), builder.shl(loop.index, c64(6)))
            for i in range(AMX_ROWS):
                prefetch_ahead(builder, a.qbase, ahead, 0)
                ahead = builder.add(ahead, a.nb)
            _unpack_int4(builder, a, rows, loop.index, unpacked, times_m)
            for half in range(2):
                k = builder.add(k0, c64(64 * half))
                _tile_op(builder, "tileloadd64", _TMM_W + half, builder.gep(unpacked, [c64(64 * half)]), c64(128))
                for j, used in enumerate(a.used):
                    with builder.if_then(used):
                        x = _TMM_X + (2 * half + j) % 2
                        _tile_op(builder, "tileloadd64", x, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                        _tile_op(builder, "tdpbssd", j, _TMM_W + half, x)
        for j, used in enumerate(a.used):  # out[j, row] = sums x step of the row x the tokens' scales
            with builder.if_then(used):
                _tile_op(builder, "tilestored64", j, sums, c64(64))
                _scaled_into_out(builder, a, sums, rows, j, c64(0), False)
    _tile_op(builder, "tilerelease")


def _scaled_into_out(builder, a: _BlockArgs, sums, rows: range, j: int, g, add: bool) -> None:
    """out[j, i] = (or += with add) row n of the stored sums tile x (row i's weight scale of group g x activation tile
    j's token scales of group g) for the block rows i = rows[n]."""
    xd = vload(builder, a.xd[j], builder.shl(g, c64(4)), VF)
    for n, i in enumerate(rows):
        c = builder.sitofp(vload(builder, sums, c64(64 * n), V32), VF)
        scale = builder.fmul(splat(builder, load_at(builder, a.row_scales[i], g)), xd)
        off = c64(j * AMX_BLOCK_ROWS * AMX_ROWS + AMX_ROWS * i)
        vstore(builder, vfma(builder, c, scale, vload(builder, a.outa.data, off, VF)) if add
                else builder.fmul(c, scale), a.outa.data, off)


def _int8_tiles_dot(builder, a: _BlockArgs):
    """32 INT8 rows, one weight tile of 16 at a time over the whole row x up to INT8_TOKEN_TILES activation tiles
    (tmm0-3 their sums): each weight tile loaded once a step for all of them; after each group the sums are stored and
    scaled into out."""
    bp = I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    copied = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(a.qbase, I64), c64(63)), c64(0))
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            for i in range(AMX_BLOCK_ROWS):
                vstore(builder, cvec(VF, 0.0), a.outa.data, c64(j * AMX_BLOCK_ROWS * AMX_ROWS + AMX_ROWS * i))
    _tile_config(builder)
    for w in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = builder.gep(a.qbase, [builder.mul(a.nb, c64(AMX_ROWS * w))])
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                _tile_op(builder, "tilezero", j)

        def step(weights, stride, k):
            _tile_op(builder, "tileloadd64", _TMM_W, weights, stride)
            for j, used in enumerate(a.used):
                with builder.if_then(used):
                    x = _TMM_X + j % 2
                    _tile_op(builder, "tileloadd64", x, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                    _tile_op(builder, "tdpbssd", j, _TMM_W, x)
            with builder.if_then(a.group_ends(builder, k)):
                for j, used in enumerate(a.used):
                    with builder.if_then(used):
                        _tile_op(builder, "tilestored64", j, sums, c64(64))
                        _tile_op(builder, "tilezero", j)
                        _scaled_into_out(builder, a, sums, range(AMX_ROWS * w, AMX_ROWS * (w + 1)), j,
                                         builder.lshr(k, a.gs), True)

        _int8_row_steps(builder, a, rows, aligned, copied, step, True)
    _tile_op(builder, "tilerelease")


def _int8_row_steps(builder, a: _BlockArgs, rows, aligned, copied, step, prefetch: bool) -> None:
    """step(weights, stride, k) for each 64-weight step k of the 16 INT8 rows from `rows`, the weight tile straight
    from storage where the rows start on cache lines, else copied first (a tile row across two lines loads 6x
    slower); with prefetch, these rows' next steps are prefetched."""
    with cgutils.for_range(builder, builder.lshr(a.nb, c64(6))) as loop:
        k = builder.shl(loop.index, c64(6))
        offs = [builder.add(k, builder.mul(c64(i), a.nb)) for i in range(AMX_ROWS)]
        if prefetch:
            for off in offs:
                prefetch_ahead(builder, rows, off, 512)
        with builder.if_else(aligned) as (direct, unaligned):
            with direct:
                step(builder.gep(rows, [k]), a.nb, k)
            with unaligned:
                for i, off in enumerate(offs):
                    vstore(builder, vload(builder, rows, off, B64), copied, c64(64 * i))
                step(copied, c64(64), k)


def _int8_block_dot(builder, a: _BlockArgs):
    """32 INT8 rows as two weight tiles, each against each activation tile in turn over the whole row: one tile of
    sums, stored after each group and scaled into 16 fp32 vectors that stay in registers (no load / store of out
    per group), two tile loads a multiply (weights straight from storage when it starts on cache lines)."""
    bp = I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    copied = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(a.qbase, I64), c64(63)), c64(0))
    accs = [cgutils.alloca_once(builder, VF) for _ in range(AMX_ROWS)]  # registers after mem2reg
    _tile_config(builder)
    _tile_op(builder, "tilezero", _TMM_SUMS)
    for half in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = builder.gep(a.qbase, [builder.mul(a.nb, c64(AMX_ROWS * half))])
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                for acc in accs:
                    builder.store(cvec(VF, 0.0), acc)

                def step(weights, stride, k):  # weights k..k + 63 of the 16 rows x activation tile j
                    _tile_op(builder, "tileloadd64", _TMM_W, weights, stride)
                    _tile_op(builder, "tileloadd64", _TMM_X, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                    _tile_op(builder, "tdpbssd", _TMM_SUMS, _TMM_W, _TMM_X)
                    with builder.if_then(a.group_ends(builder, k)):
                        _tile_op(builder, "tilestored64", _TMM_SUMS, sums, c64(64))
                        _tile_op(builder, "tilezero", _TMM_SUMS)
                        g = builder.lshr(k, a.gs)
                        xd = vload(builder, a.xd[j], builder.shl(g, c64(4)), VF)
                        for i, acc in enumerate(accs):
                            c = builder.sitofp(vload(builder, sums, c64(64 * i), V32), VF)
                            scale = builder.fmul(splat(builder, load_at(builder, a.row_scales[AMX_ROWS * half + i], g)),
                                                 xd)
                            builder.store(vfma(builder, c, scale, builder.load(acc)), acc)

                # the rows' next steps prefetched once, for this activation tile and the next
                _int8_row_steps(builder, a, rows, aligned, copied, step, j == 0)
                op = builder.gep(a.outa.data, [c64(j * AMX_BLOCK_ROWS * AMX_ROWS + AMX_ROWS * AMX_ROWS * half)])
                for i, acc in enumerate(accs):
                    vstore(builder, builder.load(acc), op, c64(16 * i))
    _tile_op(builder, "tilerelease")


# perfect-shuffle masks: lane 2i of a row pair's interleave is row a's lane i (+ 8 for the upper half), 2i + 1 row b's
_INTERLEAVE = [ir.Constant(ir.VectorType(I32, LANES), [h + i // 2 + LANES * (i % 2) for i in range(LANES)])
               for h in (0, LANES // 2)]


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
        for half in range(AMX_BLOCK_ROWS // LANES):
            rows = [vload(builder, sa.data, c64(LANES * (LANES * half + i)), VF) for i in range(LANES)]
            for _ in range(4):  # log2(16) rounds
                rows = [builder.shuffle_vector(rows[i // 2], rows[i // 2 + LANES // 2], _INTERLEAVE[i % 2])
                        for i in range(LANES)]
            for c in range(LANES):
                vstore(builder, rows[c], da.data, c64(AMX_BLOCK_ROWS * c + LANES * half))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tile_into_rows(typingctx, by_token, dst, rows, p0, n, w, col0, skip):
    """dst[rows[p0 + c], col0 + i] = by_token[c, i] (w empty) or += w[p0 + c] * by_token[c, i], for c < n and
    skip <= i < 32: one transposed tile of sums (transpose_sums) into its pairs' rows of act / out, two masked 16-lane
    stores a pair. Numba's loop over each pair's row slice took ~40 ns a pair: 20 ms of a 75 ms V3 down projection
    at 512 tokens."""
    if not (all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 and a.ndim == d
                for a, d in ((by_token, 2), (dst, 2), (w, 1))) and is_vec(rows, types.int64)):
        return None
    sig = types.void(by_token, dst, rows, types.int64, types.int64, w, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        ba, da, ra, wa = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 2, 5))
        p0, n, col0, skip = args[3], args[4], args[6], args[7]
        width = cgutils.unpack_tuple(builder, da.shape)[1]
        add = builder.icmp_signed(">", cgutils.unpack_tuple(builder, wa.shape)[0], c64(0))
        mask_ty, ptr_ty, align = ir.VectorType(ir.IntType(1), LANES), VF.as_pointer(), ir.Constant(I32, 4)
        masked_load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(VF, [ptr_ty, I32, mask_ty, VF]), "llvm.masked.load.v16f32.p0")
        masked_store = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [VF, ptr_ty, I32, mask_ty]), "llvm.masked.store.v16f32.p0")
        lanes = ir.VectorType(I64, LANES)
        masks = [builder.icmp_signed(">=", ir.Constant(lanes, [h * LANES + i for i in range(LANES)]),
                                     splat(builder, skip, lanes)) for h in range(AMX_BLOCK_ROWS // LANES)]
        with cgutils.for_range(builder, n) as loop:
            p = builder.add(p0, loop.index)
            base = builder.gep(da.data, [builder.add(builder.mul(load_at(builder, ra.data, p), width), col0)],
                               inbounds=True)
            for h, mask in enumerate(masks):
                v = vload(builder, ba.data, builder.add(builder.mul(loop.index, c64(AMX_BLOCK_ROWS)),
                                                           c64(h * LANES)), VF)
                ptr = builder.bitcast(builder.gep(base, [c64(h * LANES)], inbounds=True), ptr_ty)
                with builder.if_else(add) as (weighted, stored):
                    with weighted:
                        old = builder.call(masked_load, [ptr, align, mask, cvec(VF, 0.0)])
                        v_add = vfma(builder, v, splat(builder, load_at(builder, wa.data, p)), old)
                        builder.call(masked_store, [v_add, ptr, align, mask])
                    with stored:
                        builder.call(masked_store, [v, ptr, align, mask])
        return context.get_dummy_value()

    return sig, codegen

def bf16_tiles_in_hardware() -> bool:
    """Whether AMX-BF16 tiles run here: the compile target has AMX-BF16 and the OS granted the tile state."""
    return configure_numba().enabled("amx-bf16") and amx_permitted()


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
    _tile_config(builder)
    for i in range(2):
        for j in range(2):
            at = builder.gep(c_rows, [builder.add(builder.mul(c64(16 * i), c_stride), c64(64 * j))])
            if load_sums:
                _tile_op(builder, "tileloadd64", 2 * i + j, at, c_stride)
            else:
                _tile_op(builder, "tilezero", 2 * i + j)
    with cgutils.for_range(builder, steps) as loop:
        for i in range(2):
            a_at = builder.add(builder.mul(c64(16 * i), a_stride), builder.shl(loop.index, c64(6)))
            _tile_op(builder, "tileloadd64", _TMM_W + i, builder.gep(a_rows, [a_at]), a_stride)
        for j in range(2):
            b_at = builder.add(builder.mul(builder.shl(loop.index, c64(4)), b_stride), c64(64 * j))
            _tile_op(builder, "tileloadd64", _TMM_X + j, builder.gep(b_rows, [b_at]), b_stride)
        for i in range(2):
            for j in range(2):
                _tile_op(builder, "tdpbf16ps", 2 * i + j, _TMM_W + i, _TMM_X + j)
    for i in range(2):
        for j in range(2):
            at = builder.gep(c_rows, [builder.add(builder.mul(c64(16 * i), c_stride), c64(64 * j))])
            _tile_op(builder, "tilestored64", 2 * i + j, at, c_stride)
    _tile_op(builder, "tilerelease")


@intrinsic
def amx_bf16_scores(typingctx, q, r0, kt, c0, steps, st):
    """st[i, c0 + c] = q[r0 + i] . key c0 + c for i, c < 32 (two row tiles x two key tiles of 16), over 32 steps
    dims: q [rows, 32 steps] bf16 bits, kt [dims / 2, 2 KB] the keys in AMX's VNNI layout (row d holds dims 2d, 2d + 1
    of every key, key c at columns 2c, 2c + 1), st [32, KB] fp32. Emits nothing where the compile target has no
    AMX-BF16 (callers check bf16_tiles_in_hardware)."""
    if not _bf16_tile_args(q, kt, st):
        return None
    sig = types.void(q, types.int64, kt, types.int64, types.int64, st)

    def codegen(context, builder, sig, args):
        if configure_numba().enabled("amx-bf16"):
            a_rows, a_stride = _byte_rows(context, builder, sig.args[0], args[0], args[1], c64(0))
            b_rows, b_stride = _byte_rows(context, builder, sig.args[2], args[2], c64(0), builder.shl(args[3], c64(1)))
            c_rows, c_stride = _byte_rows(context, builder, sig.args[5], args[5], c64(0), args[3])
            _bf16_tile_block(builder, a_rows, a_stride, b_rows, b_stride, c_rows, c_stride, args[4], False)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def amx_bf16_values(typingctx, p, vv, c0, steps, o, r0):
    """o[r0 + i, c0 + e] += sum over keys k < 32 steps of p[i, k] * value e of key k, for i, e < 32: p [32, KB] the
    probabilities as bf16 bits, vv [KB / 2, 2 Dv] the values in VNNI layout (row k holds keys 2k, 2k + 1: dim e at
    columns 2e, 2e + 1), o [rows, Dv] fp32, loaded into the tiles and stored back. Emits nothing where the compile
    target has no AMX-BF16."""
    if not _bf16_tile_args(p, vv, o):
        return None
    sig = types.void(p, vv, types.int64, types.int64, o, types.int64)

    def codegen(context, builder, sig, args):
        if configure_numba().enabled("amx-bf16"):
            a_rows, a_stride = _byte_rows(context, builder, sig.args[0], args[0], c64(0), c64(0))
            b_rows, b_stride = _byte_rows(context, builder, sig.args[1], args[1], c64(0), builder.shl(args[2], c64(1)))
            c_rows, c_stride = _byte_rows(context, builder, sig.args[4], args[4], args[5], args[2])
            _bf16_tile_block(builder, a_rows, a_stride, b_rows, b_stride, c_rows, c_stride, args[3], True)
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


AMX = amx_in_hardware()
AMX_BF16 = bf16_tiles_in_hardware()
