"""End-to-end prefill and decode throughput of the Engine on a published model's shapes.

`--arch deepseek-v2-lite` (default): V2-Lite's shapes (hidden 2048, 64 routed experts of 1408, top-6,
2 shared experts, MLA with kv_lora_rank 512), cut to --layers layers (default 8, as in the llama.cpp
figure of shared/MEASURED.md; --layers 27 is the full 16B model, ~29 GB of bf16 on disk).
`--arch qwen3-30b-a3b`: Qwen3-30B-A3B's shapes (hidden 2048, GQA 32 heads / 4 kv heads, 128 routed
experts of 768, top-8, no shared expert), cut to --layers layers (1.2 GB of bf16 experts per layer).
`--arch deepseek-v4-flash`: DeepSeek-V4-Flash's shapes (hidden 4096, 256 routed experts of 2048, top-6, one shared
expert, 64 heads sharing one 512-wide KV head, mHC over 4 streams), cut to --layers layers (use 3): its first layer
(sliding window only, hash-MoE) and then the published pattern from its third layer on (CSA, HCA, ...), routed
MoE from the second layer; the routed experts written as the hub stores them, FP4 (random e2m1 codes, e8m0 scales
per 32: 3.4 GB a layer; in bf16 they would be 12.9 GB) and served as stored (--kt-method FP4), the dense weights
bf16. No transformers row (its bf16 experts would need 39 GB at 3 layers) and no llama.cpp row: gguf, llama.cpp's
format library, has no DeepSeek-V4 architecture, so no GGUF of it can be written.
Weights are random.
Routed experts run on the CPU as INT4 (Numba); the "GPU side" runs on the CPU when no GPU is
present, its linear layers quantized per --cpu-dense-method (INT8 by default, `none` = torch in --dtype).
Printed next to each figure, measured in the same run:
- the decode bound: measured memory bandwidth / bytes read per token (active experts at their
  quantized size + every non-expert weight once per step, at its stored size);
- the Python overhead of a decode step, three ways: the time of batch-1 decode's forward and sampling spent outside
  the compiled (numba) kernels at these shapes; of that, the layers' share (the compiled decode plan's Python
  around its calls, runtime/compiled_decode.py); and the same layers at tiny widths (the compute is ~0; the
  per-layer Python, kernel launches and thread wake-ups, routing, scheduling and sampling are all there), each as
  a share of the real step;
- transformers' `generate` on the same checkpoint (bf16, its eager MoE), batch 1;
- with --llamacpp-gguf (the same checkpoint converted by bench/_llamacpp_peer.py, e.g. Q4_0 and Q8_0):
  llama.cpp's prefill and batch-1 decode, run by --llamacpp-python (a side venv with llama-cpp-python)
  with ktlite's thread count, and the bits per weight each side reads per decode token.

    python bench/e2e.py [--arch deepseek-v2-lite|qwen3-30b-a3b] [--layers 8] [--batches 1,4,16] [--prefill-len 512,4096]
                        [--cpu-dense-method auto|INT8|INT4|none] [--cpu-activations auto|int8|fp32]
                        [--kv-cache-dtype auto|bfloat16|fp8_e4m3] [--write]
                        [--llamacpp-gguf X.Q4_0.gguf,X.Q8_0.gguf --llamacpp-python SIDE_VENV/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from _results_page import markdown_table, publish
from cpu_moe import memory_bandwidth  # the same reference as the CPU-expert bench

from ktlite import Engine
from ktlite.config import EngineConfig
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.models import build
from ktlite.runtime.models.config import parse_config
from ktlite.runtime.tiny_model import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {"deepseek-v2-lite": "DeepSeek-V2-Lite", "qwen3-30b-a3b": "Qwen3-30B-A3B", "deepseek-v4-flash": "DeepSeek-V4-Flash"}
FP4_EXPERTS = ("deepseek-v4-flash",)  # routed experts written as the hub's FP4 (too large in bf16), served as stored
# the same depth, experts and routing at tiny widths: a decode step's cost without the matmuls
TINY_WIDTHS = {
    "deepseek-v2-lite": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "kv_lora_rank": 32,
                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 1024},
    "qwen3-30b-a3b": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "head_dim": 16,
                      "vocab_size": 1024},
    "deepseek-v4-flash": {"hidden_size": 64, "moe_intermediate_size": 32, "q_lora_rank": 32, "o_lora_rank": 32,
                          "head_dim": 32, "qk_rope_head_dim": 8, "index_head_dim": 16, "vocab_size": 1024},
}


def cut_layers(raw: dict, arch: str, layers: int) -> None:
    """The published config cut to `layers` layers: the first ones, but DeepSeek-V4-Flash keeps one sliding-only
    hash-MoE layer and then its pattern from the third layer (CSA, HCA, ...), so three layers hold every kind."""
    raw["num_hidden_layers"] = layers
    raw.pop("mlp_only_layers", None)
    if arch == "deepseek-v4-flash":
        ratios = raw["compress_ratios"]
        raw.update(compress_ratios=ratios[:1] + ratios[2:layers + 1], num_hash_layers=1)
        raw.pop("quantization_config")  # dense weights bf16; the routed experts FP4 (fp4_experts)


def fp4_experts(cfg, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random FP4 routed experts of one layer under the hub's names: e2m1 codes two a byte ([out, in / 2] int8) and an
    e8m0 scale per 32 inputs (`<base>.scale`) making the weights' spread ~1 / sqrt(in) as the bf16 ones'."""
    tensors = {}
    for e in range(cfg.n_routed_experts):
        for proj in ("gate", "up", "down"):
            name = cfg.expert_weight_name(layer, e, proj)
            out, k = ((cfg.hidden_size, cfg.moe_intermediate_size) if proj == "down"
                      else (cfg.moe_intermediate_size, cfg.hidden_size))
            tensors[name] = torch.randint(0, 256, (out, k // 2), dtype=torch.uint8, generator=gen).view(torch.int8)
            power = round(math.log2(1.0 / (2.9 * k**0.5)))  # random e2m1 codes have a spread of ~2.9
            scale = torch.full((out, k // 32), 127 + power, dtype=torch.uint8)
            tensors[name.removesuffix("weight") + "scale"] = scale.view(torch.float8_e8m0fnu)
    return tensors


def write_checkpoint(path: Path, arch: str, layers: int, overrides: dict | None = None) -> Path:
    """Random bf16 weights with the published config's shapes (and `overrides`), one safetensors shard
    per layer (bounded RAM), under the checkpoint's own tensor names."""
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    raw = json.loads((ROOT / "tests" / "data" / arch / "config.json").read_text())
    cut_layers(raw, arch, layers)
    raw.update(overrides or {})
    cfg = parse_config(raw)
    fp4 = arch in FP4_EXPERTS
    routed = {cfg.expert_weight_name(layer, e, p) for layer in cfg.moe_layers for e in range(cfg.n_routed_experts)
              for p in ("gate", "up", "down")} if fp4 else set()
    model = build(cfg, "meta", torch.bfloat16)
    state = model.state_dict()  # meta tensors: shapes and dtypes only
    shapes, dtypes = {n: t.shape for n, t in state.items()}, {n: t.dtype for n, t in state.items()}
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        key = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(key, []).append(name)
    for key, names in tqdm(groups.items(), desc=f"writing random {ARCHS[arch]}-shaped checkpoint", unit="shard"):
        tensors = fp4_experts(cfg, int(key), g) if fp4 and key != "other" and int(key) in cfg.moe_layers else {}
        for n in names:
            shape, stored = shapes[n], model.checkpoint_name(n)
            if stored in routed:
                continue
            if not dtypes[n].is_floating_point:  # DeepSeek-V4's hash-MoE table: top-k distinct experts per token id
                t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:shape[1]] for _ in range(shape[0])])
                tensors[stored] = t.to(dtypes[n])
                continue
            if n.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                t = torch.randn(shape, generator=g) * (1.0 / shape[-1] ** 0.5)
            fp32 = n.endswith("mlp.gate.weight") or dtypes[n] == torch.float32  # routers, mHC, sinks
            tensors[stored] = t.float() if fp32 else t.to(torch.bfloat16)
        fname = f"model-{key}.safetensors"
        save_file(tensors, str(path / fname))
        weight_map.update({n: fname for n in tensors})
    index = {"metadata": {"total_size": sum((path / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": weight_map}  # transformers requires the metadata block
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    train_tokenizer().save(str(path / "tokenizer.json"))  # ids beyond its vocab decode to nothing
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return path


def bytes_per_decode_token(engine: Engine) -> int:
    """Bytes one decode step of one token must read: non-expert weights + k active CPU experts."""
    cfg = engine.runtime.runner.config
    held = allocated_by_component(engine.runtime.runner.model)  # quantized linears' buffers included
    # an embedding lookup reads one row; routed experts are counted at top-k below
    dense = sum(v for c, v in held.items() if c not in ("embeddings", "gpu_experts"))
    cpu = engine.runtime.cpu_moe
    # mean bytes of a routed expert over both stores (a large GPU may hold every expert, the CPU none)
    on_cpu = cpu.nbytes() if cpu is not None else 0
    per_expert = (on_cpu + held.get("gpu_experts", 0)) / (len(cfg.moe_layers) * cfg.n_routed_experts)
    return int(dense + len(cfg.moe_layers) * cfg.num_experts_per_tok * per_expert)


async def decode_rate(engine: Engine, batch: int, prompt_len: int, gen: int) -> tuple[float, float]:
    """(aggregate decode tok/s, seconds to first token of the batch) for `batch` concurrent requests."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = {"temperature": 0.0, "max_tokens": gen, "ignore_eos": True}
    stamps: list[list[float]] = [[] for _ in range(batch)]
    start = time.perf_counter()

    async def one(i: int):
        async for _ in engine.stream(input_ids=prompts[i], sampling_params=params):
            stamps[i].append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(batch)))
    first = max(s[0] for s in stamps)  # decode runs at full batch once every prompt is in
    last = max(s[-1] for s in stamps)
    tokens_after = sum(sum(1 for t in s if t > first) for s in stamps)
    return tokens_after / (last - first), first - start


def outside_kernels(engine: Engine, prompt_len: int, gen: int) -> tuple[float, float, float | None]:
    """Seconds per batch-1 decode step spent outside the compiled kernels' calls: (in the forward and sampling,
    that as a share of their time, in the layers: the compiled plan's Python around its blocks, None where no plan
    ran). Every numba function of the kernel modules (ktlite/kernels/cpu, where their Python callers read them) is
    wrapped in a timer for the run (after a warm-up: the compiled code already resolved the names it calls, so the
    wrappers see only calls from Python)."""
    import numba

    from ktlite.kernels.cpu import activations, amx_kernels, device_blocks, int8_dots, linear_kernels, moe_kernels
    from ktlite.runtime.compiled_decode import DecodePlan
    from ktlite.runtime.scheduler import Scheduler

    asyncio.run(decode_rate(engine, 1, prompt_len, gen))  # warm: every compiled call of a decode step exists
    spent = dict.fromkeys(("kernels", "step", "plan", "plan kernels"), 0.0)
    steps, in_plan = [0], [False]

    def timed(fn, key: str):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                spent[key] += took
                spent["plan kernels"] += took if key == "kernels" and in_plan[0] else 0.0
                steps[0] += key == "step"
        return run

    def plan_run(fn):
        timed_run = timed(fn, "plan")

        def run(*args):
            in_plan[0] = True
            try:
                return timed_run(*args)
            finally:
                in_plan[0] = False
        return run

    modules = (activations, amx_kernels, device_blocks, int8_dots, linear_kernels, moe_kernels)
    originals = {(module, name): f for module in modules for name, f in vars(module).items()
                 if isinstance(f, numba.core.registry.CPUDispatcher)}
    step, plan = Scheduler._forward_and_sample, DecodePlan.run
    try:
        for (module, name), f in originals.items():
            setattr(module, name, timed(f, "kernels"))
        Scheduler._forward_and_sample, DecodePlan.run = timed(step, "step"), plan_run(plan)
        asyncio.run(decode_rate(engine, 1, prompt_len, gen))
    finally:
        for (module, name), f in originals.items():
            setattr(module, name, f)
        Scheduler._forward_and_sample, DecodePlan.run = step, plan
    outside = (spent["step"] - spent["kernels"]) / steps[0]
    layers = (spent["plan"] - spent["plan kernels"]) / steps[0] if spent["plan"] else None
    return outside, outside * steps[0] / spent["step"], layers


def prefill_rate(engine: Engine, prompt_len: int) -> float:
    """Prompt tokens per second of one whole prompt; the warm-up prompt differs from the timed one in
    every token, so the prefix cache has nothing to reuse."""
    g = torch.Generator().manual_seed(7)
    warm, timed = (torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for _ in range(2))
    timed[0] = (warm[0] + 1) % 1000  # no shared prefix at all
    engine.generate(input_ids=warm, sampling_params={"max_tokens": 1})
    t = time.perf_counter()
    engine.generate(input_ids=timed, sampling_params={"max_tokens": 1, "ignore_eos": True})
    return prompt_len / (time.perf_counter() - t)


def _slowdown(rates: dict[int, float], n: int) -> str:
    """How a longer prompt's prefill rate compares with the shortest one's (the first measured)."""
    first = next(iter(rates))
    return f"{rates[n] / rates[first]:.2f} of the {first}-token rate" if n != first else ""


def transformers_decode_rate(path: Path, prompt_len: int, gen: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
        t2 = time.perf_counter()
    del model
    return (gen - 1) / ((t2 - t1) - (t1 - t0))


def llamacpp_rates(python: str, gguf: str, threads: int, args: argparse.Namespace) -> dict:
    """bench/_llamacpp_peer.py's JSON for one GGUF, in its own process: llama-cpp-python lives in a side venv,
    and its threads must not compete with the Engine's (which has exited by then)."""
    cmd = [python, str(ROOT / "bench" / "_llamacpp_peer.py"), "bench", gguf, "--threads", str(threads),
           "--prompt-len", str(args.prompt_len), "--prefill-len", args.prefill_len, "--gen", str(args.gen),
           "--flash-attn"]  # as llama.cpp's users run long prompts
    return json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill-len", default="512", help="prompt lengths of the prefill rows, comma-separated "
                    "(e.g. 512,4096,16384)")
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--kt-method", default=None, help="CPU expert format (default INT4; FP4, as stored, for "
                    "deepseek-v4-flash)")
    ap.add_argument("--cpu-dense-method", default="auto", help="the device side's linear layers on a CPU device")
    ap.add_argument("--cpu-activations", default="auto", help="int8, fp32 or auto: what INT4/INT8 CPU rows dot")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's dtype (auto: the activations'; bfloat16 "
                    "or fp8_e4m3 put a CPU with AMX-BF16 on its tiles for prefill attention)")
    ap.add_argument("--dir", default="/tmp/ktlite-bench")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--write", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    ap.add_argument("--llamacpp-gguf", action="append", default=[],
                    help="GGUF(s) of this checkpoint for llama.cpp rows (repeatable or comma-separated)")
    ap.add_argument("--llamacpp-python", default=sys.executable, help="a python with llama-cpp-python")
    args = ap.parse_args()
    args.kt_method = args.kt_method or ("FP4" if args.arch in FP4_EXPERTS else "INT4")
    args.skip_transformers |= args.arch in FP4_EXPERTS  # bf16 experts beyond this machine's RAM (docstring)

    path = write_checkpoint(Path(args.dir) / f"{args.arch}-{args.layers}layers", args.arch, args.layers)
    threads = torch.get_num_threads()
    bw = memory_bandwidth(threads)
    rows = []
    # dtype auto: bf16 on a GPU, fp32 on the CPU (whose bf16 GEMMs are slow without AVX512-BF16/AMX)
    prefill_lens = [int(n) for n in args.prefill_len.split(",")]
    longest = max(prefill_lens)
    flags = {"kt_method": args.kt_method, "dtype": "auto", "max_total_tokens": max(16384, longest + 1024),
             "chunked_prefill_size": 512, "context_length": max(4096, longest + 64),
             "cpu_dense_method": args.cpu_dense_method, "cpu_activations": args.cpu_activations,
             "kv_cache_dtype": args.kv_cache_dtype}
    config = EngineConfig.from_kwargs(str(path), **flags)
    dense = config.cpu_dense_quantization or f"in {str(config.torch_dtype).removeprefix('torch.')} torch"
    with Engine(str(path), **flags) as engine:
        per_token = bytes_per_decode_token(engine)
        bound = bw * 1e9 / per_token
        prefill = {n: prefill_rate(engine, n) for n in prefill_lens}
        for n, rate in prefill.items():
            rows.append(("prefill", f"{n} tokens", f"{rate:.1f} tok/s", _slowdown(prefill, n)))
        for b in [int(x) for x in args.batches.split(",")]:
            asyncio.run(decode_rate(engine, b, args.prompt_len, 4))  # warm-up pass, as the llama.cpp peer's
            rate, ttft = asyncio.run(decode_rate(engine, b, args.prompt_len, args.gen))
            note = f"{rate / bound:.2f} of the bound ({bound:.1f} tok/s)" if b == 1 else f"{rate / b:.1f} tok/s per request"
            rows.append((f"decode batch {b}", f"prompt {args.prompt_len}, {args.gen} new", f"{rate:.1f} tok/s", note))
        python, python_share, layers_python = outside_kernels(engine, args.prompt_len, args.gen)
    ours = float(rows[len(prefill_lens)][2].split()[0])  # batch-1 decode tok/s
    step = 1 / ours
    tiny = write_checkpoint(Path(args.dir) / f"{args.arch}-{args.layers}layers-tiny", args.arch, args.layers,
                            TINY_WIDTHS[args.arch])
    with Engine(str(tiny), **flags) as engine:
        asyncio.run(decode_rate(engine, 1, args.prompt_len, args.gen))  # warm
        overhead = 1 / asyncio.run(decode_rate(engine, 1, args.prompt_len, args.gen))[0]
    rows.append(("decode Python", "batch 1: forward and sampling outside the compiled kernels", f"{python * 1e3:.2f} ms/step",
                 f"{python_share:.1%} of the forward and sampling's time"))
    rows.append(("decode Python in the layers", "batch 1: the compiled plan's Python around its kernels",
                 "no plan ran" if layers_python is None else f"{layers_python * 1e3:.2f} ms/step",
                 "" if layers_python is None else
                 f"{layers_python / step:.1%} of the step, {layers_python / args.layers * 1e6:.0f} us a layer"))
    rows.append(("decode overhead", f"the same {args.layers} layers at tiny widths, batch 1", f"{overhead * 1e3:.1f} ms/step",
                 f"{overhead / step:.1%} of the step above ({step * 1e3:.1f} ms)"))
    peers = [llamacpp_rates(args.llamacpp_python, g, threads, args) for a in args.llamacpp_gguf for g in a.split(",")]
    for p in peers:  # bits per weight over what one decode token reads: the same weights on both sides
        kind = p["file_type"]
        theirs = {int(n): rate for n, rate in p["prefill_tok_s"].items()}  # JSON keys are strings
        for n in prefill_lens:
            note = "; ".join(filter(None, (f"ktlite is {prefill[n] / theirs[n]:.2f}x", _slowdown(theirs, n))))
            rows.append((f"llama.cpp {kind} prefill", f"{n} tokens", f"{theirs[n]:.1f} tok/s", note))
        bits = 8 * p["bytes_per_token"] / p["weights_per_token"]
        rows.append((f"llama.cpp {kind} decode batch 1", f"prompt {args.prompt_len}, {args.gen} new, {bits:.2f} bits/weight",
                     f"{p['decode_tok_s']:.1f} tok/s", f"ktlite is {ours / p['decode_tok_s']:.2f}x at "
                     f"{8 * per_token / p['weights_per_token']:.2f} bits/weight"))
    if not args.skip_transformers:
        hf = transformers_decode_rate(path, args.prompt_len, args.gen)
        rows.append(("transformers generate", "batch 1, bf16", f"{hf:.2f} tok/s", f"ktlite is {ours / hf:.1f}x"))

    head = (f"{ARCHS[args.arch]} shapes cut to {args.layers} layers, random weights, "
            f"CPU experts {args.kt_method}, " + (
                f"device side on CPU with its linear layers {dense} (--cpu-dense-method {args.cpu_dense_method}), "
                if config.torch_device.type == "cpu" else
                f"device side on {config.torch_device} in {str(config.torch_dtype).removeprefix('torch.')} "
                f"(GPU experts as the plan places them; the bound below is the CPU's, which does not apply), ") +
            f"{'int8' if config.cpu_int8_activations else 'fp32'} activations for INT4/INT8 "
            f"rows (--cpu-activations {args.cpu_activations}), KV pool "
            f"{str(config.torch_kv_dtype).removeprefix('torch.')} (--kv-cache-dtype {args.kv_cache_dtype}) "
            f"(torch threads {threads}).\n"
            f"Measured in the same run: memory bandwidth {bw:.1f} GB/s (numpy read, {threads} threads); one decode token reads "
            f"{per_token / 1e6:.0f} MB, so the bandwidth bound for batch-1 decode is {bw * 1e9 / per_token:.1f} tok/s.\n")
    if peers:
        head += (f"llama.cpp: llama-cpp-python {peers[0]['llama_cpp']}, {threads} threads, flash attention on, on GGUFs "
                 f"converted from this "
                 f"checkpoint (bench/_llamacpp_peer.py), weights in {peers[0]['weights_in']}; bits/weight = bytes one "
                 f"decode token reads x 8 / the weights it "
                 f"reads (routed experts at top-k, no embedding), for both sides.\n")
    table = markdown_table(["what", "shape", "ktlite", "note"], rows)
    publish("e2e", "End to end (bench/e2e.py)", head + "\n" + table, args.write)


if __name__ == "__main__":
    main()
