"""Serving benchmark (like SGLang's bench_serving): streamed /v1/chat/completions under load.

A synthetic ShareGPT-like mix (prompt and output lengths drawn from fixed-seed log-normal
distributions, clipped) is replayed at a chosen concurrency and/or Poisson request rate. Every
request streams with `ignore_eos` so it produces exactly its drawn output length, and asks for the
usage chunk so token counts come from the server. Reported per run: completed/failed requests,
request throughput, input and output tok/s, TTFT, inter-token latency (ITL, per streamed chunk),
time per output token (TPOT) and end-to-end latency (mean, p50, p99), plus the server's own
token-level TTFT/ITL means (from /metrics deltas; they also count tokens that decode to no text).

Against a running server:
    python bench/serving.py --url http://127.0.0.1:30000 --num-prompts 200 --concurrency 32
In-process (starts the engine + server on 127.0.0.1, ephemeral port), with a sweep of one knob:
    python bench/serving.py --model /path/to/ckpt --engine-flags '{"kt_method": "INT4"}' \\
        --sweep kt_cpuinfer=1,2 --sweep chunked_prefill_size=64,256
    python bench/serving.py --tiny   # the tiny random test model, written to /tmp/ktlite-tiny-serving

Everything targets the given URL only; each run is bounded by --num-prompts and --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

WORDS = ("the of and to in is was for on that with as by at from his her they this which or had not are but "
         "were have one all their there been has when who will more no if out so said what up its about into than "
         "them can only other new some could time these two may then do first any my now such like our over man "
         "me even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last might us great old "
         "year off come since against go came right used take three").split()


@dataclass
class BenchRequest:
    prompt: str
    prompt_words: int
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # None: no text came back (ids outside the tokenizer's vocab decode to nothing)
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def sample_requests(n: int, seed: int = 0, prompt_median: float = 48, prompt_sigma: float = 0.8,
                    output_median: float = 48, output_sigma: float = 0.7, max_prompt: int = 128,
                    max_output: int = 128) -> list[BenchRequest]:
    """A ShareGPT-like mix: log-normal prompt/output lengths (ShareGPT's are heavy-tailed), clipped.
    Prompt lengths are in words (one to two tokens each for the test tokenizers)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = int(min(max_prompt, max(4, rng.lognormvariate(math.log(prompt_median), prompt_sigma))))
        o = int(min(max_output, max(1, rng.lognormvariate(math.log(output_median), output_sigma))))
        words = [f"#{i}"] + [rng.choice(WORDS) for _ in range(p - 1)]
        out.append(BenchRequest(" ".join(words), p, o))
    return out


async def one_request(session: aiohttp.ClientSession, url: str, req: BenchRequest, model: str | None,
                      timeout: float, api_key: str | None = None, api: str = "chat") -> Result:
    body: dict[str, Any] = {"stream": True, "max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:  # a checkpoint without a chat template
        body["prompt"] = req.prompt
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = Result()
    t0 = time.perf_counter()
    last = None
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url.rstrip("/") + path, json=body, headers=headers) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return res
                done = False
                async for raw in r.content:
                    line = raw.strip()
                    if not line:
                        continue
                    if not line.startswith(b"data: "):
                        res.error = f"bad SSE line {line[:80]!r}"
                        return res
                    data = line[6:]
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = f"error event: {obj['error'].get('message')}"
                        return res
                    if obj.get("usage"):
                        res.prompt_tokens = obj["usage"]["prompt_tokens"]
                        res.output_tokens = obj["usage"]["completion_tokens"]
                    for choice in obj.get("choices") or []:
                        if (choice["delta"].get("content") if "delta" in choice else choice.get("text")):
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - t0
                            else:
                                res.itl.append(now - last)
                            last = now
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                if not done or res.finish_reason is None:
                    res.error = "stream ended without a finish_reason and [DONE]"
                    return res
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - t0
    res.ok = True
    return res


async def run_benchmark(url: str, requests: list[BenchRequest], concurrency: int = 32,
                        request_rate: float = math.inf, model: str | None = None, seed: int = 0,
                        timeout: float = 300.0, api_key: str | None = None, api: str = "chat"
                        ) -> tuple[list[Result], float]:
    """Replay `requests` (at most `concurrency` at once, Poisson arrivals at `request_rate`/s).
    -> (results in request order, wall seconds)."""
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(max(1, concurrency))
    connector = aiohttp.TCPConnector(limit=max(1, concurrency) + 4)

    async def guarded(session, req):
        async with sem:
            return await one_request(session, url, req, model, timeout, api_key, api)

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(guarded(session, req)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    out: dict[str, float] = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration if duration > 0 else 0.0,
        "input_tok_per_s": sum(r.prompt_tokens for r in ok) / duration if duration > 0 else 0.0,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
    }
    out["ttft_measured"] = sum(r.ttft is not None for r in ok)
    for name, vals in (("ttft", [r.ttft for r in ok if r.ttft is not None]), ("itl", itl), ("tpot", tpot),
                       ("e2e", [r.latency for r in ok])):
        out[f"{name}_mean_ms"] = statistics.fmean(vals) * 1e3 if vals else float("nan")
        out[f"{name}_p50_ms"] = _pct(vals, 50) * 1e3
        out[f"{name}_p99_ms"] = _pct(vals, 99) * 1e3
    return out


COLUMNS = [("config", "config", "{}"), ("ok/n", None, None), ("req/s", "req_per_s", "{:.2f}"),
           ("in tok/s", "input_tok_per_s", "{:.0f}"), ("out tok/s", "output_tok_per_s", "{:.1f}"),
           ("TTFT mean", "ttft_mean_ms", "{:.0f}"), ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
           ("TTFT p99", "ttft_p99_ms", "{:.0f}"), ("ITL mean", "itl_mean_ms", "{:.1f}"),
           ("ITL p50", "itl_p50_ms", "{:.1f}"), ("ITL p99", "itl_p99_ms", "{:.1f}"),
           ("TPOT mean", "tpot_mean_ms", "{:.1f}"), ("E2E p50", "e2e_p50_ms", "{:.0f}"),
           ("srv TTFT mean", "server_ttft_mean_ms", "{:.0f}"), ("srv ITL mean", "server_itl_mean_ms", "{:.1f}")]


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table (times in ms)."""
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for title, key, fmt in COLUMNS:
            value = row.get(key, float("nan")) if key else None
            cells.append(f"{row['completed']}/{row['requests']}" if key is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_SERVER_HISTS = {"ttft": "ktlite_time_to_first_token_seconds", "itl": "ktlite_inter_token_latency_seconds"}


async def server_histograms(url: str, api_key: str | None = None) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's token-level TTFT and ITL histograms from /metrics ({} if absent).
    These count every token, including ids that decode to no text and so send no chunk."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession() as s, s.get(url.rstrip("/") + "/metrics", headers=headers) as r:
            text = await r.text()
    except aiohttp.ClientError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if value and not line.startswith("#") and "{" not in name else values.get(name, 0)
    return {k: (values[f"{m}_sum"], values[f"{m}_count"]) for k, m in _SERVER_HISTS.items()
            if f"{m}_sum" in values and f"{m}_count" in values}


def server_means(before: dict, after: dict) -> dict[str, float]:
    out = {}
    for k in _SERVER_HISTS:
        if k in before and k in after and after[k][1] > before[k][1]:
            out[f"server_{k}_mean_ms"] = (after[k][0] - before[k][0]) / (after[k][1] - before[k][1]) * 1e3
    return out


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def _parse_sweeps(specs: list[str]) -> list[dict[str, Any]]:
    """['kt_cpuinfer=1,2', 'chunked_prefill_size=64,256'] -> one dict per combination."""
    axes = []
    for spec in specs:
        key, _, values = spec.partition("=")
        axes.append([(key.strip().replace("-", "_"), json.loads(v)) for v in values.split(",") if v])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def _tiny_model() -> str:
    from pathlib import Path

    from ktlite.runtime.tiny_model import write_tiny_model

    path = Path("/tmp/ktlite-tiny-serving/v3")
    if not (path / "config.json").is_file():
        write_tiny_model(path, "deepseek_v3", seed=1)
    return str(path)


TINY_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 8192, "chunked_prefill_size": 256,
              "max_running_requests": 32, "gpu_memory": "2GiB", "served_model_name": "tiny"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="A running server (http://127.0.0.1:PORT).")
    ap.add_argument("--model", help="Start an in-process engine + server on this checkpoint instead.")
    ap.add_argument("--tiny", action="store_true", help="In-process, on the tiny random test model.")
    ap.add_argument("--engine-flags", default="{}", help="JSON dict of Engine flags for --model/--tiny.")
    ap.add_argument("--sweep", action="append", default=[], help="KEY=v1,v2: an engine flag to sweep (repeatable).")
    ap.add_argument("--served-model", default=None, help="The 'model' field to send (default: none).")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--api", choices=["chat", "completions"], default="chat",
                    help="chat: /v1/chat/completions (default); completions: /v1/completions (no chat template).")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-median", type=float, default=48, help="Median prompt length in words.")
    ap.add_argument("--output-median", type=float, default=48)
    ap.add_argument("--max-prompt-len", type=int, default=128, help="In words (~2 tokens each).")
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=4, help="Requests sent (and not counted) before each run.")
    ap.add_argument("--timeout", type=float, default=600.0, help="Per-request limit in seconds.")
    ap.add_argument("--json", dest="json_out", default=None, help="Also write the rows as JSON here.")
    args = ap.parse_args(argv)
    if sum(bool(x) for x in (args.url, args.model, args.tiny)) != 1:
        ap.error("give exactly one of --url, --model, --tiny")

    reqs = sample_requests(args.num_prompts, args.seed, args.prompt_median, output_median=args.output_median,
                           max_prompt=args.max_prompt_len, max_output=args.max_output_len)
    warm = sample_requests(args.warmup, args.seed + 1000, 16, output_median=4, max_prompt=32, max_output=8)
    print(f"{len(reqs)} requests: prompt words mean {statistics.fmean(r.prompt_words for r in reqs):.0f} "
          f"(max {max(r.prompt_words for r in reqs)}), output tokens mean "
          f"{statistics.fmean(r.output_len for r in reqs):.0f} (max {max(r.output_len for r in reqs)}); "
          f"concurrency {args.concurrency}, request rate {args.request_rate}/s", flush=True)

    def bench(url: str, label: str) -> dict[str, Any]:
        async def go():
            if warm:
                await run_benchmark(url, warm, args.concurrency, model=args.served_model, api_key=args.api_key,
                                    api=args.api)
            before = await server_histograms(url, args.api_key)
            out = await run_benchmark(url, reqs, args.concurrency, args.request_rate, args.served_model, args.seed,
                                      args.timeout, args.api_key, args.api)
            return out, server_means(before, await server_histograms(url, args.api_key))

        load0 = _loadavg()
        (results, duration), srv = asyncio.run(go())
        row = {"config": label, **summarize(results, duration), **srv, "loadavg_before": load0,
               "loadavg_after": _loadavg()}
        errors = [r.error for r in results if not r.ok]
        if errors:
            print(f"  {len(errors)} failed, e.g. {errors[0]}", file=sys.stderr)
        if row["ttft_measured"] < row["completed"]:
            print(f"  note: {row['completed'] - row['ttft_measured']} requests sent no text at all (ids outside the "
                  "tokenizer's vocab); client TTFT/ITL cover the rest, srv columns count every token", flush=True)
        print(f"  {label}: {row['completed']}/{row['requests']} ok in {duration:.1f} s, "
              f"{row['output_tok_per_s']:.1f} out tok/s (load avg {load0} -> {row['loadavg_after']})", flush=True)
        return row

    rows = []
    if args.url:
        rows.append(bench(args.url, args.url))
    else:
        from ktlite import Engine
        from ktlite.server import ServerOptions, ServerThread

        model = _tiny_model() if args.tiny else args.model
        base = {**(TINY_FLAGS if args.tiny else {}), **json.loads(args.engine_flags)}
        for combo in _parse_sweeps(args.sweep):
            flags = {**base, **combo}
            label = ", ".join(f"{k}={v}" for k, v in combo.items()) or "default"
            t0 = time.perf_counter()
            with Engine(model, **flags) as engine:
                print(f"[{label}] engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
                with ServerThread(engine, ServerOptions(host="127.0.0.1", port=0)) as srv:
                    rows.append(bench(srv.url, label))
    print()
    print(table(rows))
    print(f"\nload average (1/5/15 min) before/after each run: "
          + "; ".join(f"{r['config']}: {r['loadavg_before']} -> {r['loadavg_after']}" for r in rows))
    print(f"cpu count {os.cpu_count()}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
