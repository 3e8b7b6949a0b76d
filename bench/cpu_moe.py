"""Benchmark the CPU experts (ktlite/kernels/cpu) against memory bandwidth and torch matmul.

For DeepSeek-V2-Lite expert shapes (hidden 2048, moe_intermediate 1408, 64 experts, top-6) and
DeepSeek-V3 shapes (hidden 7168, moe_intermediate 2048, top-8, a few experts), T tokens per call,
each method (ktlite's INT4/INT8/BF16 and the formats kept from a checkpoint: FP8 with 128x128 block
scales, RAWINT4 = compressed-tensors INT4 group 32, LLAMAFILE = GGUF Q4_K blocks, MXFP4 = e2m1 and MXFP8 = e4m3
with an e8m0 scale per 32): time per call of CPUMoE.forward (the path it picks), both paths forced (the fused
numba GEMV/FMA kernel and dequantize + oneDNN matmul), torch bf16/fp32 matmul of the same
dequantized experts, effective weight GB/s against a numpy read benchmark, quantization error, and
submit/wait overlap, and the INT4/INT8 quantizer's speed (GB/s of bf16 source). Prints tables; with --write they replace
its section of bench/RESULTS.md (bench/_results_page.py).

    .venv/bin/python bench/cpu_moe.py            # ~3-5 min on 2 cores
    .venv/bin/python bench/cpu_moe.py --quick    # ~1 min, fewer shapes/T
    .venv/bin/python bench/cpu_moe.py --quick --shapes tiny --methods MXFP4,MXFP8   # seconds: a smoke check
    .venv/bin/python bench/cpu_moe.py --ktkernel-python SIDE/bin/python   # + kt-kernel on the same inputs

kt-kernel pins an old torch (2.9.1), so it lives in a side venv and runs in a subprocess
(bench/_ktkernel_peer.py). Its extension links no libtorch, so the CPU torch of ktlite's Makefile will do:
    python3 -m venv SIDE && SIDE/bin/pip install torch==2.13.0
    SIDE/bin/pip install --no-deps kt-kernel==0.7.2 && SIDE/bin/pip install numpy safetensors gguf pyyaml packaging
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from _results_page import section, write_section
from ktlite.kernels.cpu.gemm import expert_mlp_matmul
from ktlite.kernels.cpu.moe import Q8_METHODS, CPUMoE
from ktlite.kernels.cpu.fp8 import fill_fp8_rows
from ktlite.kernels.cpu.gguf_quants import BLOCKS
from ktlite.kernels.cpu.mx import E2M1_VALUES, MX_GROUP, MX_METHODS, fill_mx_rows
from ktlite.kernels.cpu.target import bf16_gemm_wins, configure_numba
from ktlite.kernels.cpu.quant import (
    DEFAULT_GROUP_SIZES,
    RAWINT4_GROUP,
    check_group_size,
    dequantize,
    empty_quantized,
    int8_activation_values,
    int8_activations,
    quantize,
    quantize_into,
    relative_error,
)

N_DISTINCT = 2  # experts quantized for real; the other slots are copies (timing does not care)
PEER_SCRIPT = Path(__file__).with_name("_ktkernel_peer.py")
# kt-kernel method -> the ktlite methods its rows compare with (same bits; RAWINT4 also the same format)
PEERS = {"AMXINT4": ("INT4",), "AMXINT8": ("INT8",), "RAWINT4": ("INT4", "RAWINT4"), "Q8_0": ("INT8",),
         "BF16": ("BF16",)}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    experts: int
    topk: int


V2_LITE = Shape("V2-Lite", 2048, 1408, 64, 6)
V3 = Shape("V3", 7168, 2048, 8, 8)
TINY = Shape("tiny", 256, 128, 8, 2)  # --shapes tiny: the bench's code paths in seconds, no figures worth keeping
SHAPES = {s.name: s for s in (V2_LITE, V3, TINY)}


class NumpyRead:
    """numpy summing a 256 MiB float64 array split across `threads` threads: the memory-bandwidth reference."""

    def __init__(self, threads: int):
        self.array = np.ones((256 << 20) // 8)
        self._parts = np.array_split(self.array, threads)
        self._pool = ThreadPoolExecutor(threads)

    def __call__(self, _: int = 0) -> None:
        list(self._pool.map(np.sum, self._parts))

    def close(self) -> None:
        self._pool.shutdown()


def memory_bandwidth(threads: int) -> float:
    """GB/s of NumpyRead (best of 5)."""
    read = NumpyRead(threads)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t)
    read.close()
    return read.array.nbytes / best / 1e9


def timed(fn: Callable[[int], object], budget_s: float, max_calls: int = 50) -> float:
    """Fastest seconds per call of fn(i), after one warm-up call, within about `budget_s` (the
    minimum, not the median: other processes share these cores and only ever add time)."""
    fn(0)
    times: list[float] = []
    start = time.perf_counter()
    i = 1
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < max_calls):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
        i += 1
        if times[-1] > budget_s:  # one slow call is enough
            break
    return min(times)


def timed_many(fns: dict[str, Callable[[int], object]], budget_s: float, max_calls: int = 50,
               budgets: dict[str, float] | None = None) -> dict[str, float]:
    """timed() for several variants at once, interleaved round-robin so that load from other processes
    hits every variant alike. Each round runs a short block of consecutive calls per variant and keeps
    all but the block's first (after a switch, the previous variant's OpenMP threads - torch's or
    another pool's - still spin for a while and slow the first call down; a pause before each block
    was tried and made every variant slower, the cores' caches and clocks going cold). A variant stops after its
    calls have used its budget (`budgets[k]`, else `budget_s`; at least 3 timed calls, or 1 if one call
    takes longer than the budget)."""
    budget = {k: (budgets or {}).get(k, budget_s) for k in fns}
    first = {}
    for k, fn in fns.items():
        t = time.perf_counter()
        fn(0)
        first[k] = time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in fns}
    spent = dict.fromkeys(fns, 0.0)
    i = 1
    while True:
        live = [k for k in fns if len(times[k]) < max_calls and not (
            (len(times[k]) >= 3 and spent[k] >= budget[k]) or (times[k] and times[k][0] > budget[k]))]
        if not live:
            break
        for k in live:
            block = 3 if first[k] < budget[k] / 10 else 1
            for b in range(block):
                t = time.perf_counter()
                fns[k](i)
                dt = time.perf_counter() - t
                spent[k] += dt
                i += 1
                if b or block == 1:
                    times[k].append(dt)
    return {k: min(v) for k, v in times.items()}


def make_routings(shape: Shape, t: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(t, shape.experts, generator=g).topk(shape.topk, dim=1).indices,
             torch.rand(t, shape.topk, generator=g)) for _ in range(n)]


def kept_formats(shape: Shape, method: str) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """(gate_up, down) storage of a method that keeps a checkpoint's encoding; None: ktlite quantizes."""
    if method == "FP8":
        return ("FP8", 128), ("FP8", 128)
    if method == "RAWINT4":
        return ("INT4", RAWINT4_GROUP), ("INT4", RAWINT4_GROUP)
    if method in MX_METHODS:
        return (method, MX_GROUP), (method, MX_GROUP)
    if method == "LLAMAFILE":  # Q4_K needs K % 256 == 0: V2-Lite's down (K = 1408) is Q8_0, as llama.cpp falls back
        return ("Q4_K", 256), ("Q4_K", 256) if shape.inter % 256 == 0 else ("Q8_0", 32)
    return None


def split_variant(variant: str) -> tuple[str, str]:
    """"INT4" -> ("INT4", "auto"); "INT4:fp32" -> ("INT4", "fp32"): a method and its --cpu-activations."""
    method, _, activations = variant.partition(":")
    return method, activations or "auto"


def method_label(shape: Shape, variant: str) -> str:
    method, activations = split_variant(variant)
    if activations != "auto":
        return f"{method_label(shape, method)} ({activations} act)"
    formats = kept_formats(shape, method)
    if method == "LLAMAFILE":
        return f"GGUF {formats[0][0]}" + (f" (down {formats[1][0]})" if formats[1] != formats[0] else "")
    return f"{method} (group {RAWINT4_GROUP})" if method == "RAWINT4" else method


def fill_kept(dst, w: torch.Tensor, fmt: str, seed: int) -> None:
    """Encode float weights `w` [N, K] as a checkpoint would ship them, into a slot view `dst`: FP8 with
    128x128 block scales (amax / 448), compressed-tensors INT4 (same storage as ktlite's INT4 group 32), or
    GGUF blocks (random codes with small scales: gguf-py cannot quantize K-quants, and timing does not care)."""
    if fmt == "FP8":
        n, k = w.shape
        tiles = w.reshape(n // 128, 128, k // 128, 128)
        scale = tiles.abs().amax(dim=(1, 3)) / 448.0
        q = (tiles / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
        fill_fp8_rows(dst.qweight, dst.scales, q.view(torch.uint8).numpy(), scale.numpy(), (128, 128))
    elif fmt == "INT4":
        quantize_into(dst, (), w)
    elif fmt in MX_METHODS:
        fill_mx_rows(dst.qweight, dst.scales, *mx_encode(w, fmt), fmt)
    else:
        rng = np.random.default_rng(seed)
        raw = dst.qweight.view(np.uint8)
        raw[:] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
        dst.qweight["d"] = np.float16(rng.uniform(-1e-3, 1e-3, dst.qweight.shape)).view(np.uint16)
        if "dmin" in BLOCKS[fmt][0].names:
            dst.qweight["dmin"] = np.float16(rng.uniform(0, 1e-3, dst.qweight.shape)).view(np.uint16)


def mx_encode(w: torch.Tensor, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (code bytes, e8m0 scale bytes [N, K / 32]) as an MX checkpoint ships them: e4m3 under the power of
    two >= amax / 448 (transformers' ue8m0 rule), or e2m1 under 2^(floor(log2 amax) - 2) (OCP MX v1.0), codes
    rounded to the nearest value."""
    blocks = w.float().reshape(w.shape[0], -1, MX_GROUP)
    amax = blocks.abs().amax(-1).clamp_min(2.0**-100)
    if fmt == "MXFP8":
        power = torch.ceil(torch.log2(amax / 448.0))
        codes = (blocks / torch.exp2(power)[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        power = torch.floor(torch.log2(amax)) - 2
        mags = torch.tensor(E2M1_VALUES[:8])
        scaled = blocks / torch.exp2(power)[..., None]
        nearest = torch.bucketize(scaled.abs().clamp(max=6.0), (mags[1:] + mags[:-1]) / 2)  # index of the magnitude
        nib = (nearest | torch.where(scaled < 0, 8, 0)).to(torch.uint8).reshape(w.shape[0], -1, 2)
        codes = nib[..., 0] | (nib[..., 1] << 4)
    return codes.reshape(w.shape[0], -1).numpy(), (power + 127).to(torch.uint8).numpy()


def build(shape: Shape, variant: str, src: list[tuple[torch.Tensor, ...]], group: int | None, **kw) -> CPUMoE:
    """A CPUMoE whose slots hold copies of N_DISTINCT really quantized experts (own memory each)."""
    method, activations = split_variant(variant)
    moe = CPUMoE(method, group, activations=activations, **kw)
    formats = kept_formats(shape, method)
    layer = moe.reserve_layer(0, shape.experts, shape.hidden, shape.inter, formats=formats)
    for e, (g, u, d) in enumerate(src):
        if formats is None:
            moe.set_expert(0, e, g, u, d)
        else:
            gate_up, down = moe.slot_views(0, e)
            fill_kept(gate_up, torch.cat([g, u]), formats[0][0], seed=2 * e)
            fill_kept(down, d, formats[1][0], seed=2 * e + 1)
    for e in range(N_DISTINCT, shape.experts):
        for qw in (layer.gate_up, layer.down):
            qw.qweight[e] = qw.qweight[e % N_DISTINCT]
            qw.scales[e] = qw.scales[e % N_DISTINCT]
    moe.warmup()
    return moe


def torch_moe(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, ids: torch.Tensor,
              w: torch.Tensor) -> torch.Tensor:
    """The same MoE with torch.matmul on resident dequantized experts (grouped by expert)."""
    out = torch.zeros(x.shape[0], x.shape[1])
    xd = x.to(weights[0][0].dtype)
    for e in torch.unique(ids).tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp_matmul(xd[tok], *weights[e])
        out.index_add_(0, tok, y.float() * w[tok, j][:, None])
    return out


def path_label(routes: list[tuple[torch.Tensor, torch.Tensor]], threshold: int) -> str:
    """Which path CPUMoE.forward takes for these routings (it decides per expert)."""
    counts = torch.cat([torch.bincount(r[0].flatten()) for r in routes])
    counts = counts[counts > 0]
    heavy = (counts >= threshold).float().mean().item()
    return "gemv" if heavy == 0 else "deq+oneDNN" if heavy == 1 else f"mixed ({heavy * 100:.0f} % oneDNN)"


def per_row_int4(t: torch.Tensor) -> torch.Tensor:
    s = t.abs().amax(-1, keepdim=True) / 7
    return (t / s).round().clamp(-8, 7) * s


def accuracy(src: list[tuple[torch.Tensor, ...]], variant: str, group: int | None) -> tuple[float, float]:
    """(weight relative error, MoE-output relative error) vs the unquantized expert; variant may be
    "per-row INT4" (KTransformers' layout). With int8 activations each matmul's input is quantized too."""
    method, activations = split_variant(variant)
    g, u, d = src[0]
    if method == "per-row INT4":
        qg, qu, qd = (per_row_int4(m) for m in (g, u, d))
    elif method in ("FP8", "RAWINT4", *MX_METHODS):  # the checkpoint's own encoding of these floats
        fmt = kept_formats(V3, method)[0]
        qg, qu, qd = (_kept(m, fmt) for m in (g, u, d))
    else:
        qg, qu, qd = (dequantize(quantize(m, method, group)) for m in (g, u, d))
    werr = relative_error(torch.cat([qg.flatten(), qu.flatten(), qd.flatten()]),
                          torch.cat([g.flatten(), u.flatten(), d.flatten()]))
    x = torch.randn(16, g.shape[1], generator=torch.Generator().manual_seed(5))
    exact = expert_mlp_matmul(x, torch.cat([g, u]), d)
    if method in Q8_METHODS and int8_activations(activations):
        h = int8_activation_values(x) @ torch.cat([qg, qu]).double().T
        act = torch.nn.functional.silu(h[:, :g.shape[0]]) * h[:, g.shape[0]:]
        return werr, relative_error(int8_activation_values(act.float()) @ qd.double().T, exact)
    return werr, relative_error(expert_mlp_matmul(x, torch.cat([qg, qu]), qd), exact)


def _kept(w: torch.Tensor, fmt: tuple[str, int]) -> torch.Tensor:
    dst = empty_quantized(*fmt, (), *w.shape)
    fill_kept(dst, w, fmt[0], seed=0)
    return dequantize(dst)


def quantizer_speed(shape: Shape, group: int | None) -> dict[str, float]:
    """GB/s of bf16 source the INT4/INT8 quantizer (load and `ktlite convert`) takes: 4 gate_up matrices
    of `shape` (fastest of 3 runs)."""
    w = (torch.randn(4 * 2 * shape.inter, shape.hidden, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    out = {}
    for method in ("INT4", "INT8"):
        dst = empty_quantized(method, check_group_size(method, group), (), *w.shape)
        quantize_into(dst, (slice(0, 64),), w[:64])  # compile
        out[method] = w.numel() * 2 / timed(lambda i: quantize_into(dst, (), w), 1.0, max_calls=3) / 1e9
    return out


def overlap_demo(moe: CPUMoE, shape: Shape, t: int) -> dict[str, float]:
    """submit(), then the caller works for as long as one call takes, then wait(). Two kinds of
    caller work: sleeping (like blocking on a GPU stream: the GIL is free) and a GIL-holding Python
    loop (like launching GPU kernels from Python), the latter at the default 5 ms GIL switch
    interval and at 0.2 ms."""
    x = torch.randn(t, shape.hidden)
    routes = make_routings(shape, t, 8, seed=11)
    alone = timed(lambda i: moe.forward(0, x, *routes[i % 8]), 1.0)

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def overlapped(work: Callable[[float], None]) -> tuple[float, float]:
        submit_s, both = [], []
        for i in range(8):
            t0 = time.perf_counter()
            h = moe.submit(0, x, *routes[i])
            submit_s.append(time.perf_counter() - t0)
            work(alone)
            h.wait()
            both.append(time.perf_counter() - t0)
        return min(submit_s), statistics.median(both)

    res = {"alone": alone}
    res["submit"], res["sleep"] = overlapped(time.sleep)
    _, res["busy"] = overlapped(busy)
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    try:
        _, res["busy_fast_switch"] = overlapped(busy)
    finally:
        sys.setswitchinterval(old)
    return res


@dataclass(frozen=True)
class KtPeer:
    python: str  # the side venv's python, which has kt-kernel
    methods: list[str]  # kt-kernel methods (its names; bench/_ktkernel_peer.py)
    info: dict  # its --probe answer: version, variant (which extension it loaded), torch


def run_peer(python: str, *args: str) -> str:
    """stdout of bench/_ktkernel_peer.py under `python` (the side venv: its own torch, none of our PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([python, str(PEER_SCRIPT), *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"kt-kernel peer exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def peer_rows(peer: KtPeer, shape: Shape, src: list[tuple[torch.Tensor, ...]], moes: dict[str, CPUMoE],
              inputs: dict[int, tuple[torch.Tensor, list]], rows: list[dict], budget: float) -> list[dict]:
    """kt-kernel on the experts, hidden states and routings ktlite just ran (same timing rule, in a subprocess
    after ktlite's calls), and the MoE-output error of both engines on routing 0 against one reference: the
    unquantized experts in float64, on the bf16-rounded hidden states that kt-kernel takes."""
    with tempfile.TemporaryDirectory() as tmp:
        tensors = {name: torch.stack([e[i] for e in src]) for i, name in enumerate(("gate", "up", "down"))}
        for t, (x, routes) in inputs.items():
            tensors[f"x{t}"] = x.bfloat16()
            tensors[f"ids{t}"] = torch.stack([r[0] for r in routes]).long()
            tensors[f"w{t}"] = torch.stack([r[1] for r in routes]).float()
        save_file(tensors, f"{tmp}/experts.safetensors")
        request = {"threads": numba.config.NUMBA_NUM_THREADS, "max_len": max(inputs), "budget_s": budget,
                   "long_factor": 8, "long_from": 512, "max_calls": 200, "methods": peer.methods,  # timed_many's
                   "shapes": [{"name": shape.name, "hidden": shape.hidden, "inter": shape.inter,
                               "experts": shape.experts, "topk": shape.topk, "file": f"{tmp}/experts.safetensors",
                               "tokens": list(inputs)}]}
        Path(tmp, "request.json").write_text(json.dumps(request))
        run_peer(peer.python, f"{tmp}/request.json")
        result = json.loads(Path(tmp, "result.json").read_text())
        outputs = load_file(f"{tmp}/outputs.safetensors")
    exact = [(torch.cat([g, u]).double(), d.double()) for g, u, d in src]
    exact = [exact[e % N_DISTINCT] for e in range(shape.experts)]
    ref, ktlite_err, out = {}, {}, []
    for r in result["results"]:
        if "error" in r:
            out.append({"shape": shape.name, "kt": r["method"], "error": r["error"]})
            continue
        t = r["T"]
        x, routes = inputs[t]
        xb = x.bfloat16().float()
        if t not in ref:
            ref[t] = torch_moe(exact, xb, *routes[0])
        for m in PEERS[r["method"]]:
            if m not in moes:
                continue
            if (m, t) not in ktlite_err:
                ktlite_err[m, t] = relative_error(moes[m].forward(0, xb, *routes[0]), ref[t])
            mine = next(row for row in rows if row["T"] == t and row["method"] == method_label(shape, m))
            out.append({"shape": shape.name, "T": t, "method": mine["method"], "ktlite": mine["auto"],
                        "kt": f"{r['method']} ({r['kernel']})", "kt_s": r["seconds"],
                        "ktlite_err": ktlite_err[m, t],
                        "kt_err": relative_error(outputs[f"{shape.name}/{r['method']}/{t}"], ref[t])})
    return out


def bench_shape(shape: Shape, methods: list[str], tokens: list[int], group: int | None, budget: float,
                peer: KtPeer | None = None) -> tuple[list[dict], dict]:
    g = torch.Generator().manual_seed(0)
    src = [(torch.randn(shape.inter, shape.hidden, generator=g) * 0.02,
            torch.randn(shape.inter, shape.hidden, generator=g) * 0.02,
            torch.randn(shape.hidden, shape.inter, generator=g) * 0.02) for _ in range(N_DISTINCT)]
    rows: list[dict] = []
    acc = {method_label(shape, m): accuracy(src, m, group) for m in methods + ["per-row INT4"] if m != "LLAMAFILE"}
    # torch baselines on the dequantized INT8 experts (any method would do: same shapes)
    deq = [(torch.cat([dequantize(quantize(gg, "INT8", group)), dequantize(quantize(uu, "INT8", group))]),
            dequantize(quantize(dd, "INT8", group))) for gg, uu, dd in src]
    # everything resident at once, and each T timed for all variants back to back, so that load from
    # other processes on the machine hits ktlite and the baselines alike
    baselines = {name: [(deq[e % N_DISTINCT][0].to(dtype).clone(), deq[e % N_DISTINCT][1].to(dtype).clone())
                        for e in range(shape.experts)]
                 for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))}
    moes = {m: build(shape, m, src, group) for m in methods}
    forced = {}
    for m in methods:
        method, activations = split_variant(m)
        forced[m] = {"fma": CPUMoE(method, group, prefill_threshold=1 << 30, activations=activations),
                     "onednn": CPUMoE(method, group, prefill_threshold=0)}
    for m in methods:
        for f in forced[m].values():
            f.layers = moes[m].layers
            f.pools.close()
            f.pools = moes[m].pools  # one pool thread (one OpenMP team) per method, as in the engine
    inputs: dict[int, tuple[torch.Tensor, list]] = {}  # kept for the kt-kernel peer
    reader = NumpyRead(numba.config.NUMBA_NUM_THREADS)
    for t in tqdm(tokens, desc=shape.name, leave=False):
        x = torch.randn(t, shape.hidden)
        routes = make_routings(shape, t, 16, seed=t)
        inputs[t] = (x, routes)
        touched = statistics.mean(len(torch.unique(r[0])) for r in routes)
        fns = {name: (lambda i, w=w: torch_moe(w, x, *routes[i % 16])) for name, w in baselines.items()}
        fns["read"] = reader  # the bandwidth reference, timed in the same rounds as the kernels
        for method, moe in moes.items():
            fns[(method, "auto")] = lambda i, moe=moe: moe.forward(0, x, *routes[i % 16])
            for k, f in forced[method].items():
                fns[(method, k)] = lambda i, f=f: f.forward(0, x, *routes[i % 16])
        # fast calls: up to 200 samples for the minimum; T=512 (the prefill target) gets 8x the budget for
        # ktlite, its deq+oneDNN path and torch bf16, so each has ~8 calls rather than 3
        longer = {k: 8 * budget for k in fns if t >= 512 and (k == "bf16" or (isinstance(k, tuple) and k[1] != "fma"))}
        best = timed_many(fns, budget, max_calls=200, budgets=longer)
        base = {name: best[name] for name in baselines}
        bw_now = reader.array.nbytes / best["read"] / 1e9
        for method, moe in moes.items():
            auto = best[(method, "auto")]
            paths = {k: best[(method, k)] for k in forced[method]}
            gbs = touched * moe.nbytes() / shape.experts / auto / 1e9
            rows.append({"shape": shape.name, "method": method_label(shape, method), "T": t, "auto": auto,
                         "path": path_label(routes, moe.prefill_threshold), "gbs": gbs, "bw_frac": gbs / bw_now, "bw_now": bw_now,
                         "fma": paths["fma"], "onednn": paths["onednn"], "bf16": base["bf16"], "fp32": base["fp32"]})
    del baselines
    reader.close()
    peer_out = peer_rows(peer, shape, src, moes, inputs, rows, budget) if peer else []
    for m in methods:
        moes[m].close()
    overlap = {}
    if "INT4" in methods and shape is V2_LITE:
        with build(shape, "INT4", src, group, num_threads=max(1, numba.config.NUMBA_NUM_THREADS - 1)) as moe:
            overlap = overlap_demo(moe, shape, 1)
    return rows, {"accuracy": acc, "overlap": overlap, "quantizer": quantizer_speed(shape, group), "ktkernel": peer_out}


def render(hw: dict, rows: list[dict], extra: dict[str, dict], group: int | None) -> str:
    sizes = group or ", ".join(f"{m} {g}" for m, g in DEFAULT_GROUP_SIZES.items()) + " (the defaults)"
    lines = [f"numba {numba.__version__} compiling for {hw['host']} "
             f"({hw['layer']} threading layer, {hw['threads']} threads), torch {torch.__version__} "
             f"({torch.get_num_threads()} threads). Group size {sizes}. Load average (1/5/15 min) at start "
             f"{hw['load']}, at end {hw['load_end']}: other processes share these cores, so times are the fastest "
             f"of several calls.",
             f"Measured memory bandwidth (numpy sum of 256 MiB): {hw['bw1']:.1f} GB/s with 1 thread, "
             f"**{hw['bw']:.1f} GB/s** with {hw['threads']} threads at the start. \"% BW\" is against the same read "
             "timed in the same rounds as the row's calls (`read GB/s`): this VM's bandwidth moves by up to 2x "
             "within a run.", "",
             "Times are per call (fastest of several), for one MoE layer: `ktlite` is CPUMoE.forward (the path it picks per expert by its token count); "
             "`numba GEMV` forces the fused GEMV kernel (dequantize in-kernel + fp32 FMA; with int8 activations, "
             "integer dot products), `deq+oneDNN` forces "
             f"dequantize-to-{hw['prefill']} + torch.matmul ({hw['prefill']}: {hw['prefill_why']}); `torch bf16/fp32` is torch.matmul on resident dequantized "
             "experts. All variants of one T are timed interleaved (a few calls of each per round). GB/s = bytes of the "
             "distinct experts a call touches / time. Activations (--cpu-activations): a method without a suffix "
             f"runs as the engine's auto does on this CPU ({hw['activations']} for INT4/INT8/RAWINT4 rows); "
             "`(fp32 act)` rows keep fp32 activations; quantization errors below include the int8 activations' share.", "",
             "| shape | method | T | ktlite ms | path | weight GB/s | read GB/s | % BW | numba GEMV ms | deq+oneDNN ms "
             "| torch bf16 ms | torch fp32 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['method']} | {r['T']} | {r['auto'] * 1e3:.2f} | {r['path']} | {r['gbs']:.1f} "
                     f"| {r['bw_now']:.1f} | {r['bw_frac'] * 100:.0f} % | {r['fma'] * 1e3:.2f} | {r['onednn'] * 1e3:.2f} "
                     f"| {r['bf16'] * 1e3:.2f} | {r['fp32'] * 1e3:.2f} |")
    peer = [r for ex in extra.values() for r in ex["ktkernel"]]
    if "ktkernel" in hw:
        kt = hw["ktkernel"]
        lines += ["", f"kt-kernel peer: kt-kernel {kt['version']} with its `{kt['variant']}` extension (its own CPU "
                  f"detection's pick), torch {kt['torch']} in its side venv, {hw['threads']} worker threads; "
                  "bench/_ktkernel_peer.py runs it in a subprocess right after ktlite's calls of each shape (the "
                  "same experts, bf16 hidden states, routings and timing rule, but not interleaved with ktlite's "
                  "calls). ktlite / kt-kernel < 1: ktlite is faster. Errors: the MoE output of routing 0 "
                  "(relative Frobenius) against the unquantized experts in float64, on the bf16-rounded hidden "
                  "states both engines get.", "",
                  "| shape | T | ktlite method | ktlite ms | kt-kernel method (kernel) | kt-kernel ms "
                  "| ktlite / kt-kernel | ktlite err | kt-kernel err |", "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in peer if "error" not in r):
            lines.append(f"| {r['shape']} | {r['T']} | {r['method']} | {r['ktlite'] * 1e3:.2f} | {r['kt']} "
                         f"| {r['kt_s'] * 1e3:.2f} | {r['ktlite'] / r['kt_s']:.2f} | {r['ktlite_err'] * 100:.2f} % "
                         f"| {r['kt_err'] * 100:.2f} % |")
        lines += [f"- kt-kernel {r['kt']} not built for {r['shape']}: {r['error']}" for r in peer if "error" in r]
    lines += ["", "Quantization error on gaussian weights (relative Frobenius error; MoE output = one expert's "
              "down(SiLU(gate x) * up x), 16 tokens, vs the unquantized expert):", "",
              "| shape | method | weight rel. err | MoE output rel. err |", "|---|---|---|---|"]
    for shape, ex in extra.items():
        for m, (we, oe) in ex["accuracy"].items():
            lines.append(f"| {shape} | {m}{' (KTransformers layout)' if m == 'per-row INT4' else ''} "
                         f"| {we * 100:.2f} % | {oe * 100:.2f} % |")
    lines += ["", "Quantizer (INT4/INT8 at load and in `ktlite convert`; numba, all threads), GB/s of bf16 source "
              "(4 gate_up matrices, fastest of 3):", "", "| shape | INT4 | INT8 |", "|---|---|---|"]
    for shape, ex in extra.items():
        lines.append(f"| {shape} | {ex['quantizer']['INT4']:.2f} | {ex['quantizer']['INT8']:.2f} |")
    ov = extra.get(V2_LITE.name, {}).get("overlap")
    if ov:
        a = ov["alone"] * 1e3
        lines += ["", f"Overlap (V2-Lite INT4, T=1, {max(1, hw['threads'] - 1)} kernel thread(s)); the caller works for "
                  f"as long as one call ({a:.2f} ms) between submit() and wait(); serial would be {2 * a:.2f} ms:", "",
                  f"- submit() returns in {ov['submit'] * 1e3:.3f} ms",
                  f"- caller sleeping (GIL free, like waiting on the GPU): {ov['sleep'] * 1e3:.2f} ms",
                  f"- caller in a GIL-holding Python loop, default 5 ms switch interval: {ov['busy'] * 1e3:.2f} ms",
                  f"- same with sys.setswitchinterval(2e-4): {ov['busy_fast_switch'] * 1e3:.2f} ms"]
    lines += ["", "Reading the numbers:",
              "- The machine is a shared 2-core VM: when another process takes a core, a 2-thread parallel region "
              "waits for its descheduled half and a call can take 2-20x longer. Compare rows of one run only; the "
              "load average above says how quiet the run was.",
              "- Decode (GEMV kernel): the row kernels are numba intrinsics that emit LLVM vector IR and dot the stored bytes "
              "straight with x, with a software prefetch 4 KiB ahead of each row stream (`llvm.prefetch`). With int8 "
              "activations (the default for INT4/INT8 where the CPU has AVX2) x is quantized per 32 values and a "
              "32-weight block is one integer dot product (`vpmaddubsw` + `vpmaddwd` by ones, one `vcvtdq2ps`, one FMA by "
              "weight scale x activation scale): ~8 instructions per 32 weights against ~20 for the fp32 path "
              "(`vpmovzxbd`, nibble and/shift, `vcvtdq2ps`, `vfmadd231ps` per 8-16 weights), which on AVX2 was bound by "
              "decoding (INT4 at ~60 % of bandwidth), not by memory. The numpy-sum reference is itself below the DRAM "
              "limit and moves with the VM's load, so % BW varies between runs and can exceed 100 %.",
              "- Prefill (experts with at least the switch's tokens, below): a batch of experts (<= 4096 token-expert pairs) gathers its "
              "tokens grouped by expert, runs gate_up per expert into one buffer, one SiLU * mul over the batch, "
              "down per expert, and one weighted scatter-add (numba, reading the bf16 rows). Each expert is "
              "dequantized to bf16 right before its GEMM (LLVM `fptrunc` to bfloat: `vcvtneps2bf16` on AVX512-BF16, "
              "1.5x the hand-written rounding) into a reused buffer, so oneDNN reads it from cache. The torch "
              "baseline is the same MoE written the usual way (per expert: gather, two GEMMs, SiLU * mul, "
              "index_add_) on resident bf16 experts: at V2-Lite's ~48 tokens per expert its small per-expert ops "
              "(each a parallel region) cost about a third of its time, which the batched path saves, more than "
              "the dequantize costs. At V3's 512 tokens per expert the GEMMs dominate (~93 %) and both sides run "
              "the same oneDNN GEMMs, so the dequantize (~5 %) is paid out of the smaller overhead: the two "
              "land within a few % of each other, either side of it from run to run (the ktlite and deq+oneDNN "
              "columns run the same code there and differ by as much).",
              "- The GEMV/oneDNN switch (moe.default_prefill_threshold) is 5 tokens per expert for INT4/INT8 with bf16 "
              "GEMMs and 32 with fp32 GEMMs (a CPU whose bf16 GEMM loses to fp32: twice the dequantized bytes); "
              "with int8 activations it is 24 against bf16 GEMMs and, against fp32 ones, 64 with the AVX512-VNNI "
              "tiles (128 with row dots): the integer kernels stay faster up to there (the numba GEMV and "
              "deq+oneDNN columns above).",
              "- Kept formats: FP8 decodes e4m3 in the row kernel (integer shifts + one multiply by 2^120), the same "
              "vector code as INT8; RAWINT4 is ktlite's INT4 with groups of 32; GGUF Q4_K/Q5_K/Q6_K/Q8_0 blocks are "
              "walked in the same vector IR, 16 codes at a time, with each sub-block's scale and min unpacked "
              "in scalar code (one horizontal sum per row, the mins against the 32-weight sums of x). MXFP4 / "
              "MXFP8 decode e2m1 (two a byte, interleaved back into k order by byte shuffles, looked up as bf16 "
              "bytes by `pshufb`) / e4m3 (integer ops) to whole numbers and fold the power of two into each "
              "32-weight block's e8m0 scale.",
              "- INT4 < 8 % error is out of reach for a 4-bit code with one scale per 64 gaussian weights: the "
              "rate-distortion bound at 4 bits is 2^-4 = 6.25 % per matrix; uniform levels with a per-group MSE "
              "scale search measure 9.0 % at G=64 (8.1 % at G=32, 7.0 % at G=16; these and the codebook figures from a one-off script on 8M gaussian weights, not this bench), and even the MSE-optimal "
              "16-level codebook (Lloyd-Max on the group-normalised weights, with the same scale search) measures "
              "8.65 % at G=64 (7.96 % at G=32). The MoE output compounds three matrices (~1.7x). Group-wise INT4 "
              "has 40 % less error than per-row INT4 at either level.",
              "", "Targets:"]
    for r in rows:
        if r["method"] == "INT4" and r["T"] == 1:
            lines.append(f"- {r['shape']} decode T=1 INT4 at {r['bw_frac'] * 100:.0f} % of measured bandwidth "
                         f"(target >= 85 %): {'met' if r['bw_frac'] >= 0.85 else 'MISSED'}.")
        if r["method"] in ("INT8", "INT4") and r["T"] == 512:
            ok = r["auto"] <= r["bf16"]
            lines.append(f"- {r['shape']} prefill T=512 {r['method']}: {r['auto'] * 1e3:.0f} ms vs torch bf16 "
                         f"{r['bf16'] * 1e3:.0f} ms (target: not slower): {'met' if ok else 'MISSED'}.")
    for r in peer:
        if r.get("T") == 512:
            lines.append(f"- {r['shape']} prefill T=512 {r['method']} at {r['ktlite'] / r['kt_s']:.2f}x the time of "
                         f"kt-kernel {r['kt']}; MoE-output error {r['ktlite_err'] * 100:.2f} % vs "
                         f"{r['kt_err'] * 100:.2f} % (target: below kt-kernel's): "
                         f"{'met' if r['ktlite_err'] < r['kt_err'] else 'MISSED'}.")
    for shape, ex in extra.items():
        q = min(ex["quantizer"].values())
        lines.append(f"- {shape} quantizer {q:.2f} GB/s of bf16 source (target >= 1 GB/s on two cores): "
                     f"{'met' if q >= 1 else 'MISSED'}.")
    for shape, ex in extra.items():
        if "INT4" in ex["accuracy"]:
            we, oe = ex["accuracy"]["INT4"]
            lines.append(f"- {shape} INT4 relative error {we * 100:.1f} % (weights), {oe * 100:.1f} % (MoE output) "
                         f"vs per-row INT4 {ex['accuracy']['per-row INT4'][1] * 100:.1f} % (target < 8 %): "
                         f"{'met' if we < 0.08 else 'MISSED'}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer T values and a short time budget")
    ap.add_argument("--methods", default="INT4,INT8,INT4:fp32,INT8:fp32,BF16,FP8,RAWINT4,LLAMAFILE,MXFP4,MXFP8",
                    help="methods; METHOD:fp32 / METHOD:int8 set --cpu-activations (default: auto)")
    ap.add_argument("--shapes", default="V2-Lite,V3", help=f"expert shapes, of {', '.join(SHAPES)} (tiny: a smoke "
                    "check of the code paths)")
    ap.add_argument("--group-size", type=int, default=None, help="INT4/INT8 group size [the methods' defaults]")
    ap.add_argument("--tokens", default="", help="T values (comma-separated); --quick still leaves V3's last one out")
    ap.add_argument("--write", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    ap.add_argument("--ktkernel-python", metavar="PATH",
                    help="python of a venv with kt-kernel: adds its time and error next to ktlite's")
    ap.add_argument("--ktkernel-methods", default="",
                    help="kt-kernel methods (AMXINT4,AMXINT8,RAWINT4,Q8_0,BF16); default: AMXINT4,AMXINT8 "
                         "where its extension has them, else RAWINT4,Q8_0")
    args = ap.parse_args()
    methods = args.methods.split(",")
    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens
              else [1, 16, 512] if args.quick else [1, 4, 16, 128, 512])
    budget = 0.3 if args.quick else 0.6
    threads = numba.config.NUMBA_NUM_THREADS
    native = bf16_gemm_wins()
    hw = {"prefill": "bf16" if native else "fp32",
          "prefill_why": "oneDNN's bf16 GEMM beats its fp32 one on this CPU" if native else "oneDNN's bf16 GEMM is "
                         "slower than its fp32 one on this CPU (target.bf16_gemm_wins)",
          "activations": "int8" if int8_activations("auto") else "fp32",
          "host": configure_numba().name, "threads": threads,
          "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
          "bw1": memory_bandwidth(1), "bw": memory_bandwidth(threads)}
    peer = None
    if args.ktkernel_python:  # probe first: a broken side venv fails now, not after minutes of ktlite
        info = json.loads(run_peer(args.ktkernel_python, "--probe").splitlines()[-1])
        methods_kt = args.ktkernel_methods.split(",") if args.ktkernel_methods else info["default"]
        peer = KtPeer(args.ktkernel_python, methods_kt, info)
        hw["ktkernel"] = info
    rows, extra = [], {}
    for shape in (SHAPES[name] for name in args.shapes.split(",")):
        r, e = bench_shape(shape, methods, tokens[:-1] if args.quick and shape is V3 else tokens,
                           args.group_size, budget, peer)
        rows += r
        extra[shape.name] = e
    hw["layer"] = numba.threading_layer()
    hw["load_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    text = section("cpu_moe", "CPU experts (bench/cpu_moe.py)", render(hw, rows, extra, args.group_size))
    print(text)
    if args.write:
        write_section("cpu_moe", text)


if __name__ == "__main__":
    main()
