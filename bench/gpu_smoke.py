"""End-to-end smoke on a CUDA GPU: every tiny family served with the device side on `cuda` (Triton
attention, fused MoE for the GPU experts) against the same engine with the device side on `cpu`.

    python bench/gpu_smoke.py [--archs deepseek_v3,qwen3_next] [--tokens 24] [--write]

For each family: one tiny random checkpoint, three prompts batched, greedy. Rows: the CPU run
(float32, the torch twins), the CUDA run in float32 and in bfloat16, each with half the routed
experts on the GPU (`kt_num_gpu_experts`) so the fused MoE kernels run too. Prints a markdown
table: tokens per second and how many greedy tokens match the CPU run before the first difference
(random tiny models have near-ties, and TF32/bf16 rounding may flip one; a mismatch at token 0 of
every prompt is what a broken kernel looks like); --write puts it in its section of bench/RESULTS.md.
Without CUDA it says so and exits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from _results_page import recorded, section, write_section
from ktlite import Engine
from ktlite.runtime.tiny_model import ARCH_CONFIGS, write_tiny_model

PROMPTS = ["The quick brown fox", "Once upon a time, in a", "def fibonacci(n):"]


def run(path: Path, tokens: int, **flags) -> tuple[list[list[int]], float]:
    """-> (greedy token ids per prompt, generated tokens per second of the batched call)."""
    with Engine(str(path), max_total_tokens=2048, **flags) as engine:
        engine.generate(PROMPTS[0], {"max_tokens": 2, "temperature": 0})  # compile / warm up
        start = time.perf_counter()
        results = engine.generate(PROMPTS, {"max_tokens": tokens, "temperature": 0, "ignore_eos": True})
        elapsed = time.perf_counter() - start
    return [r.token_ids for r in results], sum(len(r.token_ids) for r in results) / elapsed


def agreement(ids: list[list[int]], ref: list[list[int]]) -> str:
    """Tokens equal to the reference before the first difference, per prompt."""
    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return " / ".join(f"{prefix(a, b)}" for a, b in zip(ids, ref))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(sorted(ARCH_CONFIGS)))
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--write", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_smoke.py needs a CUDA GPU; none is visible here, so nothing was run.")
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    with recorded() as table:  # rows are printed as each family finishes
        print(f"| family | run | tok/s | greedy tokens equal to the CPU run (of {args.tokens}, per prompt) |")
        print("|---|---|---|---|")
        failures = 0
        for arch in args.archs.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                path = write_tiny_model(Path(tmp) / arch, arch=arch)
                fields = ARCH_CONFIGS[arch]
                experts = next(fields[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in fields)
                common = dict(kt_method="BF16", kt_num_gpu_experts=experts // 2)
                try:
                    ref, speed = run(path, args.tokens, device="cpu", dtype="float32", **common)
                    print(f"| {arch} | cpu float32 | {speed:.0f} | reference |", flush=True)
                    for dtype in ("float32", "bfloat16"):
                        ids, speed = run(path, args.tokens, device="cuda", dtype=dtype, **common)
                        print(f"| {arch} | cuda {dtype} | {speed:.0f} | {agreement(ids, ref)} |", flush=True)
                except Exception as exc:  # one family's failure must not hide the others' results
                    failures += 1
                    print(f"| {arch} | FAILED | - | {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
    if args.write:
        write_section("gpu_smoke", section("gpu_smoke", "End to end on the GPU (bench/gpu_smoke.py)",
                                           f"torch {torch.__version__}; every tiny family, three prompts batched, greedy "
                                           f"{args.tokens} tokens, half the routed experts on the GPU.\n\n"
                                           + table.getvalue()))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
