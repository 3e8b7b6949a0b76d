"""The AMX tile machinery (CPUs with AMX-INT8): `amx_block_dot` / `amx_folded_block_dot`, numba intrinsics that
configure the tiles and multiply blocks of 32 weight rows by tiles of 16 tokens' int8 activations, the vector
helpers that turn the tiles' sums into rows (`transpose_sums`, `tile_into_rows`), and `AMX`: whether this process
may run them (target.amx_permitted). The kernels that drive them (moe_amx, linear_amx) are amx_kernels.py; the
attention's bf16 tiles (bf16_blocks.py) reuse the tile configuration and operations here.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ktlite.kernels.cpu.quantizer import INT4_MULTIPLES
from ktlite.kernels.cpu.simd import (
    B64, I16, I32, I64, I8, LANES, V32, VF, c64, cvec, is_vec, llvm_call, load_at, prefetch_ahead, splat, vfma, vload,
    vstore,
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
TMM_SUMS, TMM_W, TMM_X = 0, 4, 6


def amx_in_hardware() -> bool:
    """Whether the AMX tiles run here: the compile target has AMX-INT8 and the OS granted the tile state."""
    return configure_numba().enabled("amx-int8") and amx_permitted()


def tile_op(builder, name, *args):
    llvm_call(builder, f"llvm.x86.{name}", ir.VoidType(), [ir.Constant(I8, a) if isinstance(a, int) else a for a in args])


def _tile_buffer(builder, size):
    """A stack buffer of size bytes for tile loads / stores: 64-byte aligned (a tile row that crosses a cache line
    splits the load: 6x slower tile loads on Sapphire Rapids)."""
    buf = cgutils.alloca_once(builder, ir.ArrayType(I8, size))
    buf.align = 64
    return buf


def tile_config(builder):
    """ldtilecfg for tmm0-7, each 16 rows x 64 bytes (int32 sums of 16 x 16, or 16 x 64 int8 operands)."""
    cfg = cgutils.alloca_once(builder, ir.ArrayType(I8, 64))
    cfg.align = 64
    ptr = builder.bitcast(cfg, I8.as_pointer())
    builder.store(ir.Constant(ir.ArrayType(I8, 64), [1] + [0] * 63), cfg)  # palette 1, start row 0
    for t in range(8):
        builder.store(ir.Constant(I16, 64), builder.bitcast(builder.gep(ptr, [c64(16 + 2 * t)]), I16.as_pointer()))
        builder.store(ir.Constant(I8, AMX_ROWS), builder.gep(ptr, [c64(48 + t)]))
    tile_op(builder, "ldtilecfg", ptr)


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
    tile_config(builder)
    for j, used in enumerate(a.used):
        with builder.if_then(used):
            tile_op(builder, "tilezero", 2 * j)
            tile_op(builder, "tilezero", 2 * j + 1)

    def flush(g):  # the sums of group g, scaled, into out; sums zeroed
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                for w in range(2):
                    tile_op(builder, "tilestored64", 2 * j + w, builder.gep(sums, [c64(1024 * (2 * j + w))]),
                             c64(64))
                    tile_op(builder, "tilezero", 2 * j + w)

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
            tile_op(builder, "tileloadd64", TMM_W + w, wp, c64(128))
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                tile_op(builder, "tileloadd64", TMM_X + j, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                for w in range(2):
                    tile_op(builder, "tdpbssd", 2 * j + w, TMM_W + w, TMM_X + j)
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
    tile_op(builder, "tilerelease")


def _int4_folded_dot(builder, a: _BlockArgs, multiples):
    """32 INT4 rows whose scales fold (amx_folded_block_dot), one weight tile of 16 at a time over the whole row x up
    to FOLDED_TOKEN_TILES activation tiles: each 64-byte step of the 16 rows unpacked once (code x m, a vpshufb table
    per row and group) for all of them, the int32 sums in tmm0-3 until the row ends, then scaled once into out."""
    bp = I8.as_pointer()
    sums = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 64), bp)
    unpacked = builder.bitcast(_tile_buffer(builder, AMX_ROWS * 128), bp)
    tables = _times_m_tables(builder)
    n_groups = cgutils.unpack_tuple(builder, multiples.shape)[1]
    tile_config(builder)
    for w in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = range(AMX_ROWS * w, AMX_ROWS * (w + 1))
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                tile_op(builder, "tilezero", j)

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
                tile_op(builder, "tileloadd64", TMM_W + half, builder.gep(unpacked, [c64(64 * half)]), c64(128))
                for j, used in enumerate(a.used):
                    with builder.if_then(used):
                        x = TMM_X + (2 * half + j) % 2
                        tile_op(builder, "tileloadd64", x, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                        tile_op(builder, "tdpbssd", j, TMM_W + half, x)
        for j, used in enumerate(a.used):  # out[j, row] = sums x step of the row x the tokens' scales
            with builder.if_then(used):
                tile_op(builder, "tilestored64", j, sums, c64(64))
                _scaled_into_out(builder, a, sums, rows, j, c64(0), False)
    tile_op(builder, "tilerelease")


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
    tile_config(builder)
    for w in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = builder.gep(a.qbase, [builder.mul(a.nb, c64(AMX_ROWS * w))])
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                tile_op(builder, "tilezero", j)

        def step(weights, stride, k):
            tile_op(builder, "tileloadd64", TMM_W, weights, stride)
            for j, used in enumerate(a.used):
                with builder.if_then(used):
                    x = TMM_X + j % 2
                    tile_op(builder, "tileloadd64", x, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                    tile_op(builder, "tdpbssd", j, TMM_W, x)
            with builder.if_then(a.group_ends(builder, k)):
                for j, used in enumerate(a.used):
                    with builder.if_then(used):
                        tile_op(builder, "tilestored64", j, sums, c64(64))
                        tile_op(builder, "tilezero", j)
                        _scaled_into_out(builder, a, sums, range(AMX_ROWS * w, AMX_ROWS * (w + 1)), j,
                                         builder.lshr(k, a.gs), True)

        _int8_row_steps(builder, a, rows, aligned, copied, step, True)
    tile_op(builder, "tilerelease")


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
    tile_config(builder)
    tile_op(builder, "tilezero", TMM_SUMS)
    for half in range(AMX_BLOCK_ROWS // AMX_ROWS):
        rows = builder.gep(a.qbase, [builder.mul(a.nb, c64(AMX_ROWS * half))])
        for j, used in enumerate(a.used):
            with builder.if_then(used):
                for acc in accs:
                    builder.store(cvec(VF, 0.0), acc)

                def step(weights, stride, k):  # weights k..k + 63 of the 16 rows x activation tile j
                    tile_op(builder, "tileloadd64", TMM_W, weights, stride)
                    tile_op(builder, "tileloadd64", TMM_X, builder.gep(a.x[j], [builder.shl(k, c64(4))]), c64(64))
                    tile_op(builder, "tdpbssd", TMM_SUMS, TMM_W, TMM_X)
                    with builder.if_then(a.group_ends(builder, k)):
                        tile_op(builder, "tilestored64", TMM_SUMS, sums, c64(64))
                        tile_op(builder, "tilezero", TMM_SUMS)
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
    tile_op(builder, "tilerelease")


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


AMX = amx_in_hardware()
