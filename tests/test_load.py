"""Load test on the tiny model, through bench/serving.py's client (bounded: fixed request counts).

- 200 streamed chat requests at concurrency 32 (ShareGPT-like mix, fixed seed): zero failures, each
  produces exactly its max_tokens (ignore_eos), and the KV pool returns to fully free.
- RSS: the server runs in this process; VmRSS after a warm-up round and after 3 more rounds of 60
  requests must not grow by more than RSS_BOUND_MIB.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S
from ktlite import Engine
from ktlite.server import ServerOptions, ServerThread

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
serving = sys.modules.setdefault("bench_serving", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(serving)

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 256,
                "max_running_requests": 32, "gpu_memory": "1GiB", "served_model_name": "tiny"}
MIX = {"prompt_median": 24, "output_median": 12, "max_prompt": 64, "max_output": 32}
RSS_BOUND_MIB = 50  # growth allowed over 3 rounds of 60 requests, after one warm-up round


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerOptions(port=0)) as s:
        yield s


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def wait_idle(engine, server, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    pool = engine.runtime.runner.kv_pool
    while time.monotonic() < deadline:
        if pool.used_tokens == 0 and pool.free_tokens == pool.num_slots and engine.scheduler.num_running == 0 \
                and engine.scheduler.num_waiting == 0 and server.server.metrics.in_flight == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"not idle: {pool.used_tokens} KV tokens in use, {engine.scheduler.num_running} running, "
                         f"{engine.scheduler.num_waiting} waiting")


def run_round(url: str, n: int, seed: int, concurrency: int = 32) -> tuple[list, float]:
    reqs = serving.sample_requests(n, seed, **MIX)
    results, duration = asyncio.run(asyncio.wait_for(
        serving.run_benchmark(url, reqs, concurrency=concurrency, model="tiny", seed=seed, timeout=120), 240))
    failed = [r.error for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {n} failed, e.g. {failed[:3]}"
    for req, res in zip(reqs, results):
        assert res.finish_reason == "length" and res.output_tokens == req.output_len  # ignore_eos: exact lengths
        assert res.prompt_tokens > 0
    return results, duration


def test_200_requests_at_concurrency_32(engine, server):
    preempt0 = engine.scheduler.preemptions
    results, duration = run_round(server.url, 200, seed=0)
    wait_idle(engine, server)
    row = serving.summarize(results, duration)
    assert row["completed"] == 200 and row["failed"] == 0
    assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
    print(f"\n200 requests at concurrency 32: {duration:.1f} s, {row['output_tok_per_s']:.0f} out tok/s, "
          f"{engine.scheduler.preemptions - preempt0} preemptions")
    print(serving.table([{"config": "tiny, load test", **row}]))


def test_rss_does_not_grow_across_rounds(engine, server):
    run_round(server.url, 60, seed=100)  # warm-up: allocator pools, caches, lazily built code paths
    wait_idle(engine, server)
    before = rss_mib()
    samples = []
    for i in range(3):
        run_round(server.url, 60, seed=101 + i)
        wait_idle(engine, server)
        samples.append(rss_mib())
    growth = samples[-1] - before
    print(f"\nRSS after warm-up {before:.0f} MiB, after each of 3 rounds of 60: "
          + ", ".join(f"{s:.0f}" for s in samples) + f" MiB (growth {growth:+.1f} MiB, bound {RSS_BOUND_MIB})")
    assert growth < RSS_BOUND_MIB, f"RSS grew {growth:.1f} MiB over 3 rounds of 60 requests"
