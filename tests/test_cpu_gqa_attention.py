"""The compiled CPU GQA kernel (ktlite/kernels/cpu/gqa_attention.py) against the torch twins.

Pools as the runtime has them: each request's K/V rows in shuffled slots, requests in shuffled rows of req_to_token.
Batches are ragged (no prefix, a 1-token chunk, a prefix spanning several key tiles, an empty request), query
heads per kv head 1/2/4/8, head dims 16/64/128 and a V head narrower than K. Pools: fp32, bf16 (read as uint16
bits) and packed FP8 head rows (kv_fp8.head_rows, with an outlier channel of 500 to 1,000 in V) — every layout the
kernel reads. Its paths, transposed tiles and rows read in place (decode and short extends at head dims >= 64),
fp32 FMAs on every x86 CPU, are both run; extends also run in bf16 block products (bf16_blocks) on each kind the
CPU has, AVX512-BF16 dots and AMX-BF16 tiles, and a kind it lacks is skipped with that reason in the test id
(`avx512_bf16_dots`, `amx_bf16_tiles`).

Bounds (the module docstring's): |kernel - twin| <= 2e-5 + 2e-5 |twin| for fp32 outputs; bf16 queries add one bf16
ulp (rtol 2^-7), the rounding of the output to q's dtype. In bf16 products: the twin over q, K, V rounded to bf16,
within 2^-8 max |V| (assert_tiles_bound).
"""

import pytest
import torch
from pool_tables import scattered_table

from ktlite.kernels import attention
from ktlite.kernels.cpu import gqa_attention as cpu_gqa
from ktlite.kernels.cpu.bf16_blocks import (
    AMX_BF16_TILES, AVX512_BF16_DOTS, BF16_PRODUCTS, FP32_PRODUCTS, products_available,
)
from ktlite.kernels.triton.kv_fp8 import head_rows
from ktlite.kernels.triton.reference import gqa_decode_torch, gqa_extend_torch

FP8 = torch.uint8  # stands for a packed FP8 pool
PREFIX, EXTEND = [0, 5, 300, 0, 7], [1, 17, 70, 130, 0]
SCALE = 0.2


def pool(lens: list[int], kv_heads: int, dim: int, dv: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """(k_buffer, v_buffer, req_to_token, req_pool_indices) with the requests' positions on shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 11
    k, v = torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dv, generator=g)
    if dtype == FP8:
        v[..., 3] = 500 * (1 + torch.rand(slots, kv_heads, generator=g))
        k, v = head_rows(dim).pack(k), head_rows(dv).pack(v)
    else:
        k, v = k.to(dtype), v.to(dtype)
    order = torch.randperm(slots, generator=g)
    req_to_token, rows = scattered_table(lens, order, g)
    return k, v, req_to_token, rows


def queries(n: int, heads: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = torch.randn(n, heads, 2 * dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    return q[..., :dim]  # a non-contiguous view, as q split from a gate


def assert_bound(out: torch.Tensor, twin: torch.Tensor, atol: float = 2e-5) -> None:
    assert out.dtype == twin.dtype and out.shape == twin.shape
    ulp = 2.0**-7 if out.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.float(), twin.float(), atol=atol, rtol=2e-5 + ulp)


def as_read(buffer: torch.Tensor) -> torch.Tensor:
    """The pool's values as the kernel reads them, fp32 [slots, heads, width] (packed FP8 rows decoded)."""
    return head_rows(buffer.shape[-1] - 4).unpack(buffer) if buffer.dtype == FP8 else buffer.float()


def assert_tiles_bound(out: torch.Tensor, q: torch.Tensor, args: tuple, lens: tuple, **extra) -> None:
    """The bf16 products' bound (gqa_attention.attend_bf16_tiles' docstring): the twin over q, K and V rounded to
    bf16 as the tiles read them, within 2^-8 max |V| (the probabilities' rounding to bf16 moves each output by at
    most 2^-9 of the largest value it averages; twice that leaves room for fp32 sums in another order)."""
    k, v, *rest = args
    rounded = (x.bfloat16().float() for x in (q, as_read(k), as_read(v)))
    twin = gqa_extend_torch(*rounded, *rest, *lens, SCALE, **extra).to(q.dtype)
    assert_bound(out, twin, atol=2e-5 + 2.0**-8 * float(as_read(v).abs().max()))


# the ways an extend's tiles multiply (test ids say which; the bf16 kinds run where the CPU has them)
TILES = [pytest.param(FP32_PRODUCTS, id="fp32_products"),
         pytest.param(AVX512_BF16_DOTS, id="avx512_bf16_dots", marks=pytest.mark.skipif(
             AVX512_BF16_DOTS not in products_available(),
             reason="avx512_bf16_dots: numba's target for this CPU has no AVX512-BF16")),
         pytest.param(AMX_BF16_TILES, id="amx_bf16_tiles", marks=pytest.mark.skipif(
             AMX_BF16_TILES not in products_available(),
             reason="amx_bf16_tiles: this CPU (or its OS) gives no AMX-BF16 tiles"))]


def extend_path(q: torch.Tensor, args: tuple, lens: tuple, tiles: int, **extra) -> None:
    """cpu_gqa.gqa_extend on one path against the twin: fp32 products within assert_bound, bf16 products within
    assert_tiles_bound."""
    out = cpu_gqa.gqa_extend(q, *args, *lens, SCALE, **extra, products=tiles)
    if tiles != FP32_PRODUCTS:
        assert_tiles_bound(out, q, args, lens, **extra)
    else:
        assert_bound(out, gqa_extend_torch(q, *args, *lens, SCALE, **extra))


# (kv heads, query heads per kv head, head dim, V head dim)
SHAPES = [(2, 1, 64, 64), (1, 2, 128, 128), (2, 4, 64, 32), (1, 8, 16, 16)]
POOLS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8rows": FP8}


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("pool_dtype", POOLS.values(), ids=POOLS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kv{}x{}_d{}_dv{}".format(*s))
def test_extend_matches_twin(shape: tuple, pool_dtype: torch.dtype, tiles: int) -> None:
    kv_heads, group, dim, dv = shape
    args = pool([p + e for p, e in zip(PREFIX, EXTEND)], kv_heads, dim, dv, pool_dtype)
    q = queries(sum(EXTEND), kv_heads * group, dim)
    lens = torch.tensor(PREFIX), torch.tensor(EXTEND)
    assert attention.select("gqa_extend", q, *args, *lens, SCALE) == "cpu"
    extend_path(q, args, lens, tiles)


@pytest.mark.parametrize("pool_dtype", POOLS.values(), ids=POOLS.keys())
def test_registry_picks_bf16_products_for_bf16_values_where_the_cpu_has_them(pool_dtype: torch.dtype) -> None:
    """The registry's call takes the CPU's fastest bf16 products (AMX-BF16 tiles, else AVX512-BF16 dots) for bf16
    and FP8 pools where it has them, fp32 products elsewhere and for fp32 pools (the exact reference setting): its
    result is that path's, bit for bit."""
    args = pool([p + e for p, e in zip(PREFIX, EXTEND)], 2, 64, 64, pool_dtype)
    q = queries(sum(EXTEND), 4, 64)
    lens = torch.tensor(PREFIX), torch.tensor(EXTEND)
    fastest = next((k for k in (AMX_BF16_TILES, AVX512_BF16_DOTS) if k in products_available()), FP32_PRODUCTS)
    kind = FP32_PRODUCTS if pool_dtype == torch.float32 else fastest
    assert BF16_PRODUCTS == fastest and cpu_gqa.pool_products(args[0]) == kind
    torch.testing.assert_close(attention.gqa_extend(q, *args, *lens, SCALE),
                               cpu_gqa.gqa_extend(q, *args, *lens, SCALE, products=kind), atol=0, rtol=0)


@pytest.mark.parametrize("runs", [1, 3])  # one run per item; key runs merged (flash-decoding)
@pytest.mark.parametrize("pool_dtype", POOLS.values(), ids=POOLS.keys())
@pytest.mark.parametrize("dim", [16, 64], ids=["d16_tiles", "d64_rows_in_place"])
def test_decode_matches_twin(dim: int, pool_dtype: torch.dtype, runs: int) -> None:
    seq_lens = [1, 37, 300, 513]
    args = pool(seq_lens, 2, dim, dim, pool_dtype)
    q = queries(len(seq_lens), 8, dim)
    twin = gqa_decode_torch(q, *args, torch.tensor(seq_lens), SCALE)
    assert_bound(cpu_gqa.gqa_decode(q, *args, torch.tensor(seq_lens), SCALE, runs=runs), twin)
    assert_bound(attention.gqa_decode(q, *args, torch.tensor(seq_lens), SCALE), twin)


@pytest.mark.parametrize("pool_dtype", POOLS.values(), ids=POOLS.keys())
def test_short_extends_read_rows_in_place(pool_dtype: torch.dtype) -> None:
    """At most FEW_ROWS rows per kv head and request (here 8 tokens x group 2) take the in-place row path."""
    prefix, extend = [0, 40, 300], [1, 3, 8]
    args = pool([p + e for p, e in zip(prefix, extend)], 2, 64, 48, pool_dtype)
    q = queries(sum(extend), 4, 64)
    lens = torch.tensor(prefix), torch.tensor(extend)
    assert max(extend) * 2 <= cpu_gqa.FEW_ROWS
    assert_bound(cpu_gqa.gqa_extend(q, *args, *lens, SCALE), gqa_extend_torch(q, *args, *lens, SCALE))


@pytest.mark.parametrize("tiles", TILES)
def test_extend_key_runs_and_chunk_boundaries(tiles: int) -> None:
    """A prompt prefilled in two chunks (the second with the first as its prefix, as the radix cache or chunked
    prefill gives) equals it prefilled at once, and both equal the twin, with key runs split or not; 8 query heads
    per kv head give several query blocks per request on both paths."""
    n, cut = 290, 200
    args = pool([n], 2, 64, 64, torch.float32 if tiles == FP32_PRODUCTS else torch.bfloat16)
    q = queries(n, 16, 64)
    for runs in (1, 4):
        first = cpu_gqa.gqa_extend(q[:cut], *args, torch.tensor([0]), torch.tensor([cut]), SCALE, runs=runs,
                                   products=tiles)
        second = cpu_gqa.gqa_extend(q[cut:], *args, torch.tensor([cut]), torch.tensor([n - cut]), SCALE, runs=runs,
                                    products=tiles)
        if tiles != FP32_PRODUCTS:
            assert_tiles_bound(torch.cat([first, second]), q, args, (torch.tensor([0]), torch.tensor([n])))
        else:
            assert_bound(torch.cat([first, second]),
                         gqa_extend_torch(q, *args, torch.tensor([0]), torch.tensor([n]), SCALE))


WINDOWS = [0, 6, 128]  # none; shorter than most prompts; longer than some (gpt-oss's 128)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("dim", [16, 64], ids=["d16_tiles", "d64"])
def test_sinks_and_window_match_twin(dim: int, with_sinks: bool, window: int, tiles: int) -> None:
    """Sinks (a per-head logit in the softmax's denominator, gpt-oss / DeepSeek-V4) and a sliding window, on the
    ragged extend batch (tiles), on decode with key runs merged or not, and on short extends (rows in place at d64)."""
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)) * 2 if with_sinks else None
    extra = {"sinks": sinks, "window": window}
    args = pool([p + e for p, e in zip(PREFIX, EXTEND)], 2, dim, dim, torch.bfloat16)
    q = queries(sum(EXTEND), 4, dim)
    lens = torch.tensor(PREFIX), torch.tensor(EXTEND)
    assert attention.select("gqa_extend", q, *args, *lens, SCALE, **extra) == "cpu"
    extend_path(q, args, lens, tiles, **extra)
    if tiles != FP32_PRODUCTS:
        return  # decode and short extends read rows in place: fp32 products
    seq_lens = torch.tensor([1, 37, 300, 513])
    args = pool(seq_lens.tolist(), 2, dim, dim, torch.float32, seed=3)
    q = queries(4, 4, dim)
    twin = gqa_decode_torch(q, *args, seq_lens, SCALE, **extra)
    for runs in (1, 3):
        assert_bound(cpu_gqa.gqa_decode(q, *args, seq_lens, SCALE, **extra, runs=runs), twin)
    prefix, extend = torch.tensor([0, 40, 300]), torch.tensor([1, 3, 8])
    args = pool((prefix + extend).tolist(), 2, dim, dim, torch.float32, seed=4)
    q = queries(12, 4, dim)
    assert_bound(cpu_gqa.gqa_extend(q, *args, prefix, extend, SCALE, **extra),
                 gqa_extend_torch(q, *args, prefix, extend, SCALE, **extra))


@pytest.mark.parametrize("tiles", TILES)
def test_bf16_queries_return_bf16(tiles: int) -> None:
    args = pool([p + e for p, e in zip(PREFIX, EXTEND)], 2, 64, 64, torch.bfloat16)
    q = queries(sum(EXTEND), 4, 64, torch.bfloat16)
    extend_path(q, args, (torch.tensor(PREFIX), torch.tensor(EXTEND)), tiles)


def test_unsupported_pool_goes_to_the_twin() -> None:
    args = pool([5], 1, 64, 64, torch.float16)
    q = queries(5, 2, 64)
    assert not cpu_gqa.accepts(q, *args)
    assert attention.select("gqa_extend", q, *args, torch.tensor([0]), torch.tensor([5]), SCALE) == "torch"
