"""Benchmark the CPU extend attention (ktlite/kernels/cpu/gqa_attention.py) on its kinds of products against torch.

One request's causal prefill of T tokens over a bf16 pool (bf16 queries), as a bf16 model's prompt runs it: each
kind of products the CPU has (fp32 FMAs; bf16 blocks on AVX512-BF16 dots and on AMX-BF16 tiles, bf16_blocks.py)
against torch's own bf16 scaled_dot_product_attention (its flash attention on oneDNN; it needs K and V of one
width, so it has no row for MLA's decompressed 192 / 128 heads). Times are the mean of a few calls after a warm
one; ns a pair = time / (query heads x the T (T + 1) / 2 causal (query, key) pairs); the last column: the fastest
kind's speed-up over fp32 products and over torch, measured in the same run. Prints a table; with --write
it replaces its section of bench/RESULTS.md (bench/_results_page.py).

    .venv/bin/python bench/cpu_attention.py              # 512 and 4096 tokens, ~1-2 min on 2 cores
    .venv/bin/python bench/cpu_attention.py --tokens 512 --calls 1   # seconds: a smoke check
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import torch

from _results_page import markdown_table, publish
from ktlite.kernels.cpu import gqa_attention
from ktlite.kernels.cpu.bf16_blocks import AMX_BF16_TILES, AVX512_BF16_DOTS, FP32_PRODUCTS, products_available

KINDS = {FP32_PRODUCTS: "fp32 products", AVX512_BF16_DOTS: "AVX512-BF16 dots", AMX_BF16_TILES: "AMX-BF16 tiles"}
# (label, kv heads, query heads per kv head, head dim, V head dim)
SHAPES = [("V2-Lite decompressed MLA", 16, 1, 192, 128), ("Qwen3-30B-A3B", 4, 8, 128, 128),
          ("16 heads, 128", 16, 1, 128, 128)]


def mean_seconds(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm: compiles, or loads numba's cache
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def cell(seconds: float, pairs: int) -> str:
    return f"{seconds * 1e3:.1f} ms ({seconds * 1e9 / pairs:.2f} ns)"


def row(label: str, kv_heads: int, group: int, dim: int, dv: int, tokens: int, calls: int) -> tuple[str, ...]:
    g = torch.Generator().manual_seed(0)
    heads = kv_heads * group
    q = torch.randn(tokens, heads, dim, generator=g).bfloat16()
    k = torch.randn(tokens, kv_heads, dim, generator=g).bfloat16()
    v = torch.randn(tokens, kv_heads, dv, generator=g).bfloat16()
    table = torch.arange(tokens, dtype=torch.int32)[None]
    lens = torch.tensor([0]), torch.tensor([tokens])
    scale = dim ** -0.5
    pairs = heads * tokens * (tokens + 1) // 2
    times = {kind: mean_seconds(lambda: gqa_attention.gqa_extend(q, k, v, table, torch.tensor([0]), *lens, scale,
                                                                 products=kind), calls)
             for kind in KINDS if kind in products_available()}
    if dim == dv:
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        times["torch"] = mean_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True), calls)
    cells = [cell(times[kind], pairs) if kind in times else "-" for kind in (*KINDS, "torch")]
    fastest = min(times.get(kind, float("inf")) for kind in KINDS)
    speedups = " / ".join(f"{times[peer] / fastest:.2f}x" if peer in times else "-" for peer in (FP32_PRODUCTS, "torch"))
    return (f"{label}: {kv_heads} x {group}, {dim} / {dv}", str(tokens), *cells, speedups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--calls", type=int, default=2, help="timed calls per cell, after one warm call")
    parser.add_argument("--write", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    rows = [row(*shape, int(t), args.calls) for t in args.tokens.split(",") for shape in SHAPES]
    header = ["shape (kv heads x group, D / Dv)", "tokens", *KINDS.values(), "torch SDPA bf16",
              "fastest kind's speed-up over fp32 products / torch"]
    body = (f"One request's causal prefill over a bf16 pool, bf16 queries, {numba.config.NUMBA_NUM_THREADS} threads; "
            f"mean of {args.calls} calls after a warm one; in brackets ns a (query head, key) pair. `-`: a kind "
            "this CPU does not have, or torch's SDPA for K and V of different widths.\n\n"
            + markdown_table(header, rows))
    publish("cpu_attention", "CPU extend attention (bench/cpu_attention.py)", body, args.write)


if __name__ == "__main__":
    main()
