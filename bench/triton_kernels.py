"""Benchmark ktlite's Triton kernels at DeepSeek-V3 shapes on a CUDA GPU.

Prints markdown tables (with --write they replace its section of bench/RESULTS.md, all of it: run without
--only for the whole page):
- MLA decode: achieved KV-read bandwidth vs the GPU's peak (decode is bandwidth-bound),
  128 heads, kv_lora_rank 512, rope 64, batch 1..64, context 1k..32k;
- MLA extend, fused MoE (bf16 / INT8 / INT4 experts), FP8 block-scaled GEMM: TFLOPS vs peak, and
  for small M the weight bandwidth, with torch (cuBLAS bf16) as the baseline where it has one;
- GQA decode (KV-read bandwidth) and extend (TFLOPS) at Qwen3-30B-A3B's attention shape (32 query
  heads, 4 kv heads, head dim 128), bf16 and fp8 pools;
- sparse MLA (DeepSeek-V3.2 attention, top-2048 slots per query): gathered-latent bandwidth and TFLOPS;
- Gated DeltaNet linear attention (Qwen3-Next shapes: 32 heads, dk = dv = 128, conv width 4 over 8192
  channels): decode state bandwidth, prefill tokens/s of the chunked vs the recurrent kernel, conv1d.

    python bench/triton_kernels.py [--quick] [--only decode|extend|moe|fp8|gqa|sparse|linear] [--peak-bw GB/s] [--peak-tflops T] [--write]

Without a CUDA GPU it says so and exits: the kernels' CPU path is the torch twin, and the
Triton interpreter measures nothing useful about GPU speed.
"""

import argparse
import logging
import math
import sys

import torch

from _results_page import recorded, section, write_section

logger = logging.getLogger(__name__)

# name fragment -> (memory GB/s, dense bf16 TFLOPS, dense fp8 TFLOPS or 0); datasheet figures
PEAKS = {
    "H200": (4800, 989, 1979),
    "H100 SXM": (3350, 989, 1979),
    "H100 PCIe": (2000, 756, 1513),
    "H100": (3350, 989, 1979),
    "H20": (4000, 148, 296),
    "A100-SXM4-80GB": (2039, 312, 0),
    "A100 80GB PCIe": (1935, 312, 0),
    "A100": (1555, 312, 0),
    "L40S": (864, 362, 733),
    "L4": (300, 121, 242),
    "RTX 4090": (1008, 165, 330),
    "RTX 3090": (936, 71, 0),
    "A10": (600, 125, 0),
}

H, KV_LORA, ROPE, NOPE = 128, 512, 64, 128  # DeepSeek-V3 attention
HIDDEN, INTER = 7168, 2048  # DeepSeek-V3 routed expert
GQA_HQ, GQA_HKV, GQA_D = 32, 4, 128  # Qwen3-30B-A3B attention
LIN_H, LIN_D, LIN_CONV, LIN_W = 32, 128, 8192, 4  # Qwen3-Next linear attention (k heads repeated to 32)


def peaks(args: argparse.Namespace) -> tuple[float, float, float]:
    name = torch.cuda.get_device_name()
    bw, bf16, fp8 = next((v for k, v in PEAKS.items() if k in name), (0, 0, 0))
    bw = args.peak_bw or bw
    bf16 = args.peak_tflops or bf16
    if not bw or not bf16:
        logger.warning("unknown GPU %r: pass --peak-bw and --peak-tflops for the ratio columns", name)
    return bw, bf16, fp8 or bf16


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def ratio(x: float, peak: float) -> str:
    return f"{x / peak:.2f}" if peak else "-"


def make_pool(lens: list[int], dtype: torch.dtype, per_token: tuple[int, ...] = (KV_LORA + ROPE,)
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    total = sum(lens)
    draw = torch.bfloat16 if dtype.itemsize == 1 else dtype  # torch has no randn for fp8
    kv = torch.randn(total, *per_token, device="cuda", dtype=draw).to(dtype)
    req_to_token = torch.zeros(len(lens), max(lens), dtype=torch.int32, device="cuda")
    slots = torch.randperm(total, device="cuda", dtype=torch.int64).to(torch.int32)  # scattered, like a used pool
    start = 0
    for i, n in enumerate(lens):
        req_to_token[i, :n] = slots[start : start + n]
        start += n
    return kv, req_to_token, torch.arange(len(lens), dtype=torch.int32, device="cuda")


def bench_decode(args: argparse.Namespace, bw: float) -> None:
    from ktlite.kernels.triton.decode_attn import mla_decode_triton

    print("\n### MLA decode (bf16 pool, 128 heads, 576-wide latent)\n")
    print("| batch | context | ms | KV GB/s | of peak |")
    print("|---|---|---|---|---|")
    batches = [1, 16, 64] if args.quick else [1, 4, 16, 32, 64]
    contexts = [1024, 8192, 32768] if args.quick else [1024, 4096, 8192, 16384, 32768]
    scale = 1 / math.sqrt(NOPE + ROPE)
    for b in batches:
        for ctx in contexts:
            if b * ctx * (KV_LORA + ROPE) * 2 > 8 << 30:  # keep the pool under 8 GiB
                continue
            kv, r2t, rows = make_pool([ctx] * b, torch.bfloat16)
            q = torch.randn(b, H, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
            seq = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            ms = bench_ms(lambda: mla_decode_triton(q, kv, r2t, rows, seq, scale, KV_LORA))
            gbs = b * ctx * (KV_LORA + ROPE) * 2 / ms / 1e6
            print(f"| {b} | {ctx} | {ms:.3f} | {gbs:.0f} | {ratio(gbs, bw)} |")
            del kv


def bench_extend(args: argparse.Namespace, peak: float) -> None:
    from ktlite.kernels.triton.extend_attn import mla_extend_triton

    print("\n### MLA extend (bf16, absorbed: 576-wide QK, 512-wide PV per head)\n")
    print("| prefix | chunk | ms | TFLOPS | of peak |")
    print("|---|---|---|---|---|")
    cases = [(0, 4096), (8192, 2048)] if args.quick else [(0, 1024), (0, 4096), (4096, 1024), (8192, 2048), (28672, 4096)]
    scale = 1 / math.sqrt(NOPE + ROPE)
    for prefix, chunk in cases:
        kv, r2t, rows = make_pool([prefix + chunk], torch.bfloat16)
        q = torch.randn(chunk, H, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
        pl = torch.tensor([prefix], dtype=torch.int32, device="cuda")
        el = torch.tensor([chunk], dtype=torch.int32, device="cuda")
        ms = bench_ms(lambda: mla_extend_triton(q, kv, r2t, rows, pl, el, scale, KV_LORA, max_extend_len=chunk))
        keys = chunk * prefix + chunk * (chunk + 1) / 2  # causal (query, key) pairs
        tflops = H * keys * 2 * (KV_LORA + ROPE + KV_LORA) / ms / 1e9
        print(f"| {prefix} | {chunk} | {ms:.3f} | {tflops:.1f} | {ratio(tflops, peak)} |")


def bench_moe(args: argparse.Namespace, bw: float, peak: float) -> None:
    from ktlite.kernels.triton.moe import fused_moe_triton
    from ktlite.kernels.triton.quant import quantize_weight

    experts, top_k = 32, 8  # 32 GPU experts of one layer, each token routed to 8 of them
    print(f"\n### Fused MoE ({experts} experts {HIDDEN}->{INTER}x2->{HIDDEN}, top-{top_k}, bf16 activations)\n")
    print("| weights | tokens | ms | TFLOPS | of peak | weight GB/s | of peak BW |")
    print("|---|---|---|---|---|---|---|")
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / INTER**0.5
    formats = {"bf16": (w13, w2, 2.0)}
    for bits in (8, 4):
        formats[f"int{bits} g128"] = (quantize_weight(w13, bits, 128), quantize_weight(w2, bits, 128), bits / 8 + 2 / 128)
    tokens_list = [1, 64, 2048] if args.quick else [1, 8, 64, 256, 1024, 4096]
    for name, (a, b, bytes_per_w) in formats.items():
        for t in tokens_list:
            x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(t, experts, device="cuda").argsort(-1)[:, :top_k].to(torch.int32)  # distinct per token
            wts = torch.rand(t, top_k, device="cuda").softmax(-1)
            ms = bench_ms(lambda: fused_moe_triton(x, a, b, ids, wts))
            tflops = t * top_k * 6 * HIDDEN * INTER / ms / 1e9
            touched = int(torch.unique(ids).numel())
            gbs = touched * 3 * HIDDEN * INTER * bytes_per_w / ms / 1e6
            print(f"| {name} | {t} | {ms:.3f} | {tflops:.1f} | {ratio(tflops, peak)} | {gbs:.0f} | {ratio(gbs, bw)} |")


def bench_fp8(args: argparse.Namespace, bw: float, peak_bf16: float, peak_fp8: float) -> None:
    from ktlite.kernels.triton.fp8 import fp8_linear_triton, supports_w8a8
    from ktlite.kernels.triton.reference import fp8_dequantize

    w8a8 = supports_w8a8(torch.device("cuda"))
    peak = peak_fp8 if w8a8 else peak_bf16
    print(f"\n### FP8 block-scaled GEMM ({'w8a8' if w8a8 else 'weight-only'}; baseline cuBLAS bf16 on the dequantized weight)\n")
    print("| layer | M | N | K | ms | TFLOPS | of peak | weight GB/s | vs bf16 matmul |")
    print("|---|---|---|---|---|---|---|---|---|")
    layers = {  # DeepSeek-V3 (N, K)
        "q_b_proj": (24576, 1536),
        "kv_b_proj": (32768, 512),
        "o_proj": (7168, 16384),
        "dense gate_up": (36864, 7168),
        "dense down": (7168, 18432),
    }
    ms_list = [1, 64, 4096] if args.quick else [1, 16, 64, 256, 1024, 4096]
    for layer, (n, k) in layers.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.float8_e4m3fn)
        s = torch.rand(math.ceil(n / 128), math.ceil(k / 128), device="cuda") * 0.01 + 1e-3
        w_bf16 = fp8_dequantize(w, s, torch.bfloat16)
        for m in ms_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = bench_ms(lambda: fp8_linear_triton(x, w, s))
            base = bench_ms(lambda: x @ w_bf16.T)
            tflops = 2 * m * n * k / ms / 1e9
            gbs = n * k / ms / 1e6
            print(f"| {layer} | {m} | {n} | {k} | {ms:.3f} | {tflops:.1f} | {ratio(tflops, peak)} "
                  f"| {gbs:.0f} ({ratio(gbs, bw)}) | {base / ms:.2f}x |")
        del w_bf16


def bench_gqa(args: argparse.Namespace, bw: float, peak: float) -> None:
    from ktlite.kernels.triton.gqa_decode_attn import gqa_decode_triton
    from ktlite.kernels.triton.gqa_extend_attn import gqa_extend_triton

    from ktlite.kernels.triton.kv_fp8 import head_rows

    scale = 1 / math.sqrt(GQA_D)
    per_token = (GQA_HKV, GQA_D)
    pools = {"bf16": None, "fp8 e4m3": head_rows(GQA_D)}  # fp8: packed rows, a scale per token and kv head

    def kv_pool(lens: list[int], packed):
        """(K, V, req_to_token, rows): bf16 buffers, or packed FP8 rows when `packed` is a layout."""
        k, r2t, rows = make_pool(lens, torch.bfloat16, per_token)  # V shares K's slot table
        v = torch.randn_like(k)
        return (k, v, r2t, rows) if packed is None else (packed.pack(k), packed.pack(v), r2t, rows)

    print(f"\n### GQA decode ({GQA_HQ} query heads, {GQA_HKV} kv heads, head dim {GQA_D}, bf16 queries)\n")
    print("| pool | batch | context | ms | KV GB/s | of peak |")
    print("|---|---|---|---|---|---|")
    batches = [1, 16, 64] if args.quick else [1, 4, 16, 32, 64]
    contexts = [1024, 8192, 32768] if args.quick else [1024, 4096, 8192, 16384, 32768]
    for name, packed in pools.items():
        for b in batches:
            for ctx in contexts:
                k, v, r2t, rows = kv_pool([ctx] * b, packed)
                q = torch.randn(b, GQA_HQ, GQA_D, device="cuda", dtype=torch.bfloat16)
                seq = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
                ms = bench_ms(lambda: gqa_decode_triton(q, k, v, r2t, rows, seq, scale))
                gbs = 2 * b * ctx * k[0].numel() * k.element_size() / ms / 1e6  # K and V bytes, scales included
                print(f"| {name} | {b} | {ctx} | {ms:.3f} | {gbs:.0f} | {ratio(gbs, bw)} |")
                del k, v

    print(f"\n### GQA extend ({GQA_HQ} query heads, {GQA_HKV} kv heads, head dim {GQA_D}, bf16 queries)\n")
    print("| pool | prefix | chunk | ms | TFLOPS | of peak |")
    print("|---|---|---|---|---|---|")
    cases = [(0, 4096), (8192, 2048)] if args.quick else [(0, 1024), (0, 4096), (4096, 1024), (8192, 2048), (28672, 4096)]
    for name, packed in pools.items():
        for prefix, chunk in cases:
            k, v, r2t, rows = kv_pool([prefix + chunk], packed)
            q = torch.randn(chunk, GQA_HQ, GQA_D, device="cuda", dtype=torch.bfloat16)
            pl = torch.tensor([prefix], dtype=torch.int64, device="cuda")
            el = torch.tensor([chunk], dtype=torch.int64, device="cuda")
            ms = bench_ms(lambda: gqa_extend_triton(q, k, v, r2t, rows, pl, el, scale, max_extend_len=chunk))
            keys = chunk * prefix + chunk * (chunk + 1) / 2  # causal (query, key) pairs
            tflops = GQA_HQ * keys * 2 * 2 * GQA_D / ms / 1e9
            print(f"| {name} | {prefix} | {chunk} | {ms:.3f} | {tflops:.1f} | {ratio(tflops, peak)} |")


def bench_sparse_mla(args: argparse.Namespace, bw: float, peak: float) -> None:
    from ktlite.kernels.triton.sparse_mla_attn import sparse_mla_triton

    topk, pool_slots = 2048, 1 << 17
    print(f"\n### Sparse MLA (bf16 pool, {H} heads, 576-wide latent, top-{topk} slots per query token)\n")
    print("| tokens | valid slots | ms | latent GB/s | of peak BW | TFLOPS | of peak |")
    print("|---|---|---|---|---|---|---|")
    # (query tokens, valid slots per row; the rest are -1 as for a context shorter than top-k)
    cases = [(1, 2048), (64, 2048), (4096, 2048)] if args.quick else \
        [(1, 2048), (8, 2048), (64, 2048), (64, 256), (1024, 2048), (4096, 2048), (4096, 512)]
    kv = torch.randn(pool_slots, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(NOPE + ROPE)
    for n, valid in cases:
        q = torch.randn(n, H, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
        slots = torch.randint(0, pool_slots, (n, topk), device="cuda")  # repeats cost the same as distinct slots
        slots[:, valid:] = -1
        ms = bench_ms(lambda: sparse_mla_triton(q, kv, slots, scale, KV_LORA))
        gbs = n * valid * (KV_LORA + ROPE) * 2 / ms / 1e6  # each selected latent counted once per query token
        tflops = n * H * valid * 2 * (KV_LORA + ROPE + KV_LORA) / ms / 1e9
        print(f"| {n} | {valid} | {ms:.3f} | {gbs:.0f} | {ratio(gbs, bw)} | {tflops:.1f} | {ratio(tflops, peak)} |")


def bench_linear_attn(args: argparse.Namespace, bw: float) -> None:
    from ktlite.kernels.triton.causal_conv_attn import causal_conv1d_triton
    from ktlite.kernels.triton.gated_delta_attn import gated_delta_rule_triton

    def inputs(lens: list[int]):
        n, b = sum(lens), len(lens)
        q, k, v = (torch.randn(n, LIN_H, LIN_D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g = -torch.rand(n, LIN_H, device="cuda") * 0.5
        beta = torch.rand(n, LIN_H, device="cuda", dtype=torch.bfloat16)
        states = torch.zeros(b, LIN_H, LIN_D, LIN_D, device="cuda")
        meta = (torch.arange(b, device="cuda"), torch.tensor(lens, device="cuda"),
                torch.zeros(b, dtype=torch.bool, device="cuda"))
        return (q, k, v, g, beta, states, *meta)

    state_bytes = LIN_H * LIN_D * LIN_D * 4 * 2  # fp32 state read + written per sequence
    print(f"\n### Gated delta rule decode ({LIN_H} heads, dk = dv = {LIN_D}, recurrent kernel)\n")
    print("| batch | ms | state GB/s | of peak |")
    print("|---|---|---|---|")
    for b in [1, 16, 64] if args.quick else [1, 4, 16, 32, 64, 128]:
        a = inputs([1] * b)
        ms = bench_ms(lambda: gated_delta_rule_triton(*a))
        gbs = b * state_bytes / ms / 1e6
        print(f"| {b} | {ms:.3f} | {gbs:.0f} | {ratio(gbs, bw)} |")

    print(f"\n### Gated delta rule prefill ({LIN_H} heads, dk = dv = {LIN_D}, bf16)\n")
    print("| sequences x tokens | chunked ms | tokens/s | recurrent ms | chunked speed-up |")
    print("|---|---|---|---|---|")
    for lens in [[4096], [512] * 8] if args.quick else [[256], [4096], [16384], [512] * 8, [2048] * 8]:
        a = inputs(lens)
        chunked = bench_ms(lambda: gated_delta_rule_triton(*a, mode="chunked"))
        recurrent = bench_ms(lambda: gated_delta_rule_triton(*a, mode="recurrent"))
        print(f"| {len(lens)} x {lens[0]} | {chunked:.3f} | {sum(lens) / chunked * 1e3:.0f} | {recurrent:.3f} "
              f"| {recurrent / chunked:.1f}x |")

    print(f"\n### Causal conv1d + SiLU ({LIN_CONV} channels, width {LIN_W}, bf16)\n")
    print("| sequences x tokens | ms | x+out GB/s | of peak |")
    print("|---|---|---|---|")
    for b, t in [(64, 1), (1, 4096)] if args.quick else [(1, 1), (64, 1), (1, 4096), (8, 2048)]:
        x = torch.randn(b * t, LIN_CONV, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(LIN_CONV, LIN_W, device="cuda", dtype=torch.bfloat16)
        conv_states = torch.zeros(b, LIN_CONV, LIN_W - 1, device="cuda", dtype=torch.bfloat16)
        meta = (torch.arange(b, device="cuda"), torch.full((b,), t, device="cuda"),
                torch.zeros(b, dtype=torch.bool, device="cuda"))
        ms = bench_ms(lambda: causal_conv1d_triton(x, conv_states, weight, *meta))
        gbs = 2 * x.numel() * 2 / ms / 1e6
        print(f"| {b} x {t} | {ms:.3f} | {gbs:.0f} | {ratio(gbs, bw)} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", choices=("decode", "extend", "moe", "fp8", "gqa", "sparse", "linear"))
    parser.add_argument("--peak-bw", type=float, default=0, help="GPU memory bandwidth, GB/s")
    parser.add_argument("--peak-tflops", type=float, default=0, help="GPU dense bf16 TFLOPS")
    parser.add_argument("--write", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/triton_kernels.py needs a CUDA GPU; none is visible here, so nothing was measured. "
              "(On CPU ktlite runs the torch twins; the Triton interpreter is for correctness only.)")
        return 0
    import triton

    bw, bf16, fp8 = peaks(args)
    with recorded() as tables:  # each bench prints its table as it measures it
        print(f"GPU: {torch.cuda.get_device_name()} (peak {bw} GB/s, {bf16} bf16 TFLOPS, {fp8} fp8 TFLOPS; torch "
              f"{torch.__version__}, Triton {triton.__version__}); \"of peak\" is the ratio to those peaks.")
        if args.only in (None, "decode"):
            bench_decode(args, bw)
        if args.only in (None, "extend"):
            bench_extend(args, bf16)
        if args.only in (None, "moe"):
            bench_moe(args, bw, bf16)
        if args.only in (None, "fp8"):
            bench_fp8(args, bw, bf16, fp8)
        if args.only in (None, "gqa"):
            bench_gqa(args, bw, bf16)
        if args.only in (None, "sparse"):
            bench_sparse_mla(args, bw, bf16)
        if args.only in (None, "linear"):
            bench_linear_attn(args, bw)
    if args.write:
        write_section("triton_kernels", section("triton_kernels", "Triton kernels (bench/triton_kernels.py)",
                                                tables.getvalue()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
