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
Grammar overhead (--response-format both): each run once plain and once with response_format
json_object (grammar-constrained sampling); compare TPOT and the server's per-token ITL (the decode
step as the server sees it) between the two rows:
    python bench/serving.py --tiny --num-prompts 16 --concurrency 8 --response-format both
In-process (starts the engine + server on 127.0.0.1, ephemeral port), with a sweep of one knob:
    python bench/serving.py --model /path/to/ckpt --engine-flags '{"kt_method": "INT4"}' \\
        --sweep kt_cpuinfer=1,2 --sweep chunked_prefill_size=64,256
    python bench/serving.py --tiny   # the tiny random test model, written to /tmp/ktlite-tiny-serving

Multi-turn workload (`--workload multi-turn`): each of --num-prompts conversations sends --turns
requests one after the other, every one resending the whole conversation so far (a chat client or a
coding agent); reported: TTFT of first and later turns, and how much of the prompts the prefix cache
served (usage.prompt_tokens_details.cached_tokens). In-process without --sweep it compares the prefix
cache off, on, and on with a KV pool of --spill-pool-tokens (forcing eviction) without and with a
host tier of --hicache-size GiB:
    python bench/serving.py --tiny --workload multi-turn --num-prompts 8 --turns 4
    python bench/serving.py --model /path/to/ckpt --workload multi-turn --spill-pool-tokens 16384

Everything targets the given URL only; each run is bounded by --num-prompts and --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
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
    messages: list[dict[str, str]] | None = None  # a whole conversation (chat API) instead of `prompt`


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
    text: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens


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


RESPONSE_FORMATS: dict[str, dict[str, Any] | None] = {"none": None, "json_object": {"type": "json_object"}}


async def one_request(session: aiohttp.ClientSession, url: str, req: BenchRequest, model: str | None,
                      timeout: float, api_key: str | None = None, api: str = "chat",
                      response_format: dict[str, Any] | None = None) -> Result:
    body: dict[str, Any] = {"stream": True, "max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}}
    if response_format is not None:  # a constrained reply ends when its JSON does, ignore_eos or not
        body["response_format"] = response_format
    if api == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
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
                        res.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    for choice in obj.get("choices") or []:
                        content = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                        if content:
                            res.text += content
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
                        timeout: float = 300.0, api_key: str | None = None, api: str = "chat",
                        response_format: dict[str, Any] | None = None) -> tuple[list[Result], float]:
    """Replay `requests` (at most `concurrency` at once, Poisson arrivals at `request_rate`/s).
    -> (results in request order, wall seconds)."""
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(max(1, concurrency))
    connector = aiohttp.TCPConnector(limit=max(1, concurrency) + 4)

    async def guarded(session, req):
        async with sem:
            return await one_request(session, url, req, model, timeout, api_key, api, response_format)

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


def table(rows: list[dict[str, Any]], columns=COLUMNS) -> str:
    """A markdown table (times in ms)."""
    head = "| " + " | ".join(c[0] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for title, key, fmt in columns:
            value = row.get(key, float("nan")) if key else None
            cells.append(f"{row['completed']}/{row['requests']}" if key is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- multi-turn workload: every turn resends the conversation so far -------------------------------

@dataclass
class Turn:
    conversation: int
    turn: int
    result: Result


async def run_conversation(session: aiohttp.ClientSession, url: str, index: int, turns: int, first_words: int,
                           turn_words: int, output_len: int, seed: int, model: str | None, timeout: float,
                           api_key: str | None) -> list[Turn]:
    """One conversation: each turn adds a user message, sends the whole history, and appends the reply."""
    rng = random.Random(seed * 7919 + index)
    messages: list[dict[str, str]] = []
    out = []
    for t in range(turns):
        words = first_words if t == 0 else turn_words
        messages.append({"role": "user", "content": f"#{index}.{t} " + " ".join(rng.choice(WORDS) for _ in range(words))})
        res = await one_request(session, url, BenchRequest("", words, output_len, messages=list(messages)), model,
                                timeout, api_key)
        out.append(Turn(index, t, res))
        if not res.ok:
            break
        messages.append({"role": "assistant", "content": res.text})
    return out


async def run_multi_turn(url: str, conversations: int, turns: int, first_words: int, turn_words: int,
                         output_len: int, concurrency: int, seed: int = 0, model: str | None = None,
                         timeout: float = 300.0, api_key: str | None = None) -> tuple[list[Turn], float]:
    """`conversations` conversations, at most `concurrency` at once. -> (every turn, wall seconds)."""
    sem = asyncio.Semaphore(max(1, concurrency))
    connector = aiohttp.TCPConnector(limit=max(1, concurrency) + 4)

    async def guarded(session, i):
        async with sem:
            return await run_conversation(session, url, i, turns, first_words, turn_words, output_len, seed, model,
                                          timeout, api_key)

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(guarded(session, i) for i in range(conversations)))
        return [t for conv in done for t in conv], time.perf_counter() - t0


def summarize_multi_turn(turns: list[Turn], duration: float) -> dict[str, float]:
    ok = [t for t in turns if t.result.ok]
    first = [t.result.ttft for t in ok if t.turn == 0 and t.result.ttft is not None]
    later = [t.result.ttft for t in ok if t.turn > 0 and t.result.ttft is not None]
    prompt = sum(t.result.prompt_tokens for t in ok)
    out: dict[str, float] = {
        "requests": len(turns), "completed": len(ok), "duration_s": duration,
        "prompt_tokens_mean": prompt / len(ok) if ok else float("nan"),
        "cached_pct": 100.0 * sum(t.result.cached_tokens for t in ok) / prompt if prompt else 0.0,
        "ttft_measured": len(first) + len(later),
    }
    for name, vals in (("ttft", first + later), ("ttft_first", first), ("ttft_later", later)):
        out[f"{name}_mean_ms"] = statistics.fmean(vals) * 1e3 if vals else float("nan")
        out[f"{name}_p50_ms"] = _pct(vals, 50) * 1e3
        out[f"{name}_p99_ms"] = _pct(vals, 99) * 1e3
    return out


MULTI_TURN_COLUMNS = [("config", "config", "{}"), ("ok/n", None, None), ("prompt tok mean", "prompt_tokens_mean", "{:.0f}"),
                      ("cached %", "cached_pct", "{:.1f}"), ("TTFT mean", "ttft_mean_ms", "{:.0f}"),
                      ("TTFT turn 1", "ttft_first_mean_ms", "{:.0f}"), ("TTFT later", "ttft_later_mean_ms", "{:.0f}"),
                      ("TTFT later p50", "ttft_later_p50_ms", "{:.0f}"), ("TTFT later p99", "ttft_later_p99_ms", "{:.0f}"),
                      ("srv TTFT mean", "server_ttft_mean_ms", "{:.0f}"), ("duration s", "duration_s", "{:.1f}")]


def multi_turn_configs(spill_pool_tokens: int | None, hicache_size: float) -> list[tuple[str, dict[str, Any]]]:
    """Prefix cache off / on, and (given a pool size that forces eviction) that pool without and with the host tier."""
    configs = [("cache off", {"disable_radix_cache": True}), ("cache on", {})]
    if spill_pool_tokens:
        small = {"max_total_tokens": spill_pool_tokens}
        configs += [(f"cache on, pool {spill_pool_tokens}", small),
                    (f"cache on, pool {spill_pool_tokens} + host {hicache_size:g} GiB", {**small, "hicache_size": hicache_size})]
    return configs


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
    ap.add_argument("--response-format", choices=["none", "json_object", "both"], default="none",
                    help="json_object: every request grammar-constrained; both: each run plain, then constrained.")
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
    ap.add_argument("--write", action="store_true", help="Replace this bench's section of bench/RESULTS.md.")
    ap.add_argument("--workload", choices=["sharegpt", "multi-turn"], default="sharegpt",
                    help="sharegpt: independent requests; multi-turn: --num-prompts conversations of --turns turns.")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: requests per conversation.")
    ap.add_argument("--first-words", type=int, default=100, help="multi-turn: words of each conversation's first message.")
    ap.add_argument("--turn-words", type=int, default=20, help="multi-turn: words of each later user message.")
    ap.add_argument("--turn-output-len", type=int, default=16, help="multi-turn: tokens of each reply.")
    ap.add_argument("--spill-pool-tokens", type=int, default=None,
                    help="multi-turn in-process: also run with a KV pool this small (eviction), without and with "
                         "the host tier (--tiny: 1024).")
    ap.add_argument("--hicache-size", type=float, default=1.0, help="multi-turn: host tier GiB for the spill runs.")
    args = ap.parse_args(argv)
    if sum(bool(x) for x in (args.url, args.model, args.tiny)) != 1:
        ap.error("give exactly one of --url, --model, --tiny")
    multi_turn = args.workload == "multi-turn"

    reqs = sample_requests(args.num_prompts, args.seed, args.prompt_median, output_median=args.output_median,
                           max_prompt=args.max_prompt_len, max_output=args.max_output_len)
    warm = sample_requests(args.warmup, args.seed + 1000, 16, output_median=4, max_prompt=32, max_output=8)
    if multi_turn:
        workload_line = (f"{args.num_prompts} conversations x {args.turns} turns (first message {args.first_words} "
                         f"words, then {args.turn_words} words and {args.turn_output_len}-token replies), concurrency "
                         f"{args.concurrency}")
    else:
        workload_line = (f"{len(reqs)} requests: prompt words mean {statistics.fmean(r.prompt_words for r in reqs):.0f} "
                         f"(max {max(r.prompt_words for r in reqs)}), output tokens mean "
                         f"{statistics.fmean(r.output_len for r in reqs):.0f} (max {max(r.output_len for r in reqs)}); "
                         f"concurrency {args.concurrency}, request rate {args.request_rate}/s")
    print(workload_line, flush=True)

    response_format: dict[str, Any] | None = None  # set per run by bench_formats

    async def workload(url: str) -> tuple[dict[str, float], list[str]]:
        """-> (summary, errors) of one run of the chosen workload."""
        if multi_turn:
            turns, duration = await run_multi_turn(url, args.num_prompts, args.turns, args.first_words,
                                                   args.turn_words, args.turn_output_len, args.concurrency,
                                                   args.seed, args.served_model, args.timeout, args.api_key)
            return summarize_multi_turn(turns, duration), [t.result.error for t in turns if not t.result.ok]
        results, duration = await run_benchmark(url, reqs, args.concurrency, args.request_rate, args.served_model,
                                                args.seed, args.timeout, args.api_key, args.api, response_format)
        return summarize(results, duration), [r.error for r in results if not r.ok]

    def bench(url: str, label: str) -> dict[str, Any]:
        async def go():
            if warm:  # a constrained warm-up also builds the grammar engine before anything is timed
                await run_benchmark(url, warm, args.concurrency, model=args.served_model, api_key=args.api_key,
                                    api=args.api, response_format=response_format)
            before = await server_histograms(url, args.api_key)
            out = await workload(url)
            return out, server_means(before, await server_histograms(url, args.api_key))

        load0 = _loadavg()
        (summary, errors), srv = asyncio.run(go())
        row = {"config": label, **summary, **srv, "loadavg_before": load0, "loadavg_after": _loadavg()}
        if errors:
            print(f"  {len(errors)} failed, e.g. {errors[0]}", file=sys.stderr)
        if row["ttft_measured"] < row["completed"]:
            print(f"  note: {row['completed'] - row['ttft_measured']} requests sent no text at all (ids outside the "
                  "tokenizer's vocab); client TTFT/ITL cover the rest, srv columns count every token", flush=True)
        figure = (f"TTFT later turns {row['ttft_later_mean_ms']:.0f} ms, {row['cached_pct']:.0f} % of prompt tokens cached"
                  if multi_turn else f"{row['output_tok_per_s']:.1f} out tok/s")
        print(f"  {label}: {row['completed']}/{row['requests']} ok in {row['duration_s']:.1f} s, {figure} "
              f"(load avg {load0} -> {row['loadavg_after']})", flush=True)
        return row

    def bench_formats(url: str, label: str) -> list[dict[str, Any]]:
        nonlocal response_format
        names = ["none", "json_object"] if args.response_format == "both" else [args.response_format]
        rows = []
        for name in names:
            response_format = RESPONSE_FORMATS[name]
            rows.append(bench(url, f"{label}, response_format={name}" if name != "none" or len(names) > 1 else label))
        return rows

    rows = []
    if args.url:
        rows.extend(bench_formats(args.url, args.url))
    else:
        from ktlite import Engine
        from ktlite.server import ServerOptions, ServerThread

        model = _tiny_model() if args.tiny else args.model
        base = {**(TINY_FLAGS if args.tiny else {}), **json.loads(args.engine_flags)}
        configs = [(", ".join(f"{k}={v}" for k, v in combo.items()) or "default", combo)
                   for combo in _parse_sweeps(args.sweep)]
        if multi_turn and not args.sweep:
            configs = multi_turn_configs(args.spill_pool_tokens or (1024 if args.tiny else None), args.hicache_size)
        for label, combo in configs:
            flags = {**base, **combo}
            t0 = time.perf_counter()
            with Engine(model, **flags) as engine:
                print(f"[{label}] engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
                with ServerThread(engine, ServerOptions(host="127.0.0.1", port=0)) as srv:
                    rows.extend(bench_formats(srv.url, label))
    # here, not at the top: tests import this module from its file, without bench/ on sys.path
    from _results_page import section, write_section

    loads = "; ".join(f"{r['config']}: {r['loadavg_before']} -> {r['loadavg_after']}" for r in rows)
    text = section("serving", "Serving (bench/serving.py)",
                   f"{workload_line}\n\n{table(rows, MULTI_TURN_COLUMNS if multi_turn else COLUMNS)}\n\n"
                   f"Load average (1/5/15 min) before -> after each run: {loads}.")
    print()
    print(text)
    if args.write:
        write_section("serving", text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
