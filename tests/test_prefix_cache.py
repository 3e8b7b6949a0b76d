"""Prefix cache: the radix tree over the KV pool, its host-memory tier, and the engine with it.

The tree and host tier are checked on bare pools (exact slot ownership, LRU leaf eviction, a host
round trip that restores the same bytes). Through the engine, greedy outputs must be identical with
the cache on and off (every run is fp32 with BF16 experts, so attention reads the same stored KV
either way): over a multi-turn conversation, interleaved requests sharing prefixes, and a pool so
small that the cache evicts and the scheduler preempts; a request sharing a long prefix must prefill
only its suffix; a load run with random aborts must end with every slot free or held by the tree
unreferenced.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import openai
import pytest
import torch
from click.testing import CliRunner

from ktlite import Engine
from ktlite.cli import main as cli_main
from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.runtime.host_cache import HostCache, host_cache_plan, runs
from ktlite.runtime.kv_cache import KVPool, TokenCacheSpec, kv_bytes_per_token
from ktlite.runtime.radix_cache import RadixCache
from ktlite.server import ServerOptions, ServerThread

EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 64,
         "gpu_memory": "1GiB", "max_running_requests": 8}
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
OFF = {"disable_radix_cache": True}

# the engine tests run on each of these checkpoint fixtures (tests/conftest.py)
MODELS = ["tiny_v3"]


@pytest.fixture(scope="module", params=MODELS)
def model_path(request) -> str:
    return str(request.getfixturevalue(request.param))


def tokens(n: int, seed: int, vocab: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def assert_owned(pool: KVPool, cache: RadixCache | None) -> None:
    """Idle: every slot is on the free list or held by exactly one tree node, nothing referenced."""
    free = list(pool._free_slots)  # noqa: SLF001 - the free list's contents, not just its length
    held = [s for x in cache.nodes() if x.slots is not None for s in x.slots] if cache else []
    assert sorted(free + held) == list(range(pool.num_slots))
    assert pool.used_tokens == 0 and pool.free_rows == pool.max_requests
    if cache is None:
        return
    assert all(x.lock == 0 for x in cache.nodes())
    assert cache.reclaimable == cache.device_tokens == len(held)
    # device residency is prefix-closed: a node on the device has its parent on the device
    assert all(x.parent.slots is not None for x in cache.nodes() if x.slots is not None)
    if cache.host is not None:
        host = [s for x in cache.nodes() if x.host is not None for s in x.host]
        assert len(set(host)) == len(host) == cache.host_tokens
        assert cache.host.free_slots + len(host) == cache.host.num_slots


# ---- the tree and the host tier on bare pools ------------------------------------------------------

SPECS = [TokenCacheSpec("k", (0, 1), (2, 3)), TokenCacheSpec("v", (0, 1), (2, 3)),
         TokenCacheSpec("index_key", (1,), (4,), torch.float64)]


def make_pool(slots: int, rows: int = 4) -> KVPool:
    return KVPool(SPECS, num_slots=slots, max_requests=rows, max_context=64, dtype=torch.float32, device="cpu")


def fingerprint(token: int, pos: int) -> float:
    return float(token * 64 + pos)


class Requests:
    """Drives a pool and cache the way the scheduler does, writing each token's KV as a value that
    identifies (token, position), so a slot read back tells which token it holds."""

    def __init__(self, pool: KVPool, cache: RadixCache):
        self.pool, self.cache = pool, cache

    def start(self, seq: list[int]) -> tuple[int, object, int]:
        row = self.pool.alloc_request()
        hit = self.cache.acquire(seq, reserve=1)
        self.pool.assign_prefix(row, hit.slots)
        return row, hit.node, hit.length

    def compute(self, row: int, seq: list[int], start: int, end: int) -> None:
        if start == end:
            return
        slots = self.pool.alloc_tokens(row, end - start)
        values = torch.tensor([fingerprint(t, start + i) for i, t in enumerate(seq[start:end])])
        for name, buf in self.pool.buffers.items():
            buf[:, slots] = values.view(1, -1, *[1] * (buf.dim() - 2)).to(buf.dtype)

    def finish(self, row: int, node, seq: list[int], computed: int) -> None:
        slots = self.pool.release_request(row)
        self.pool.free_slots(self.cache.release(node, seq[:computed], slots[:computed]) + slots[computed:])

    def run(self, seq: list[int]) -> int:
        """One request from admission to the end (all but its last token computed); -> its cached length."""
        row, node, cached = self.start(seq)
        self.compute(row, seq, cached, len(seq) - 1)
        self.finish(row, node, seq, len(seq) - 1)
        return cached

    def check_row(self, row: int, seq: list[int], n: int) -> None:
        slots = torch.tensor(self.pool.row_slots(row)[:n])
        want = torch.tensor([fingerprint(t, i) for i, t in enumerate(seq[:n])])
        for buf in self.pool.buffers.values():
            got = buf[:, slots].float().reshape(buf.shape[0], n, -1)
            assert torch.equal(got, want.view(1, n, 1).expand_as(got))


def test_shared_prefix_is_reused_and_the_last_token_never_is():
    pool = make_pool(64)
    cache = RadixCache(pool)
    req = Requests(pool, cache)
    a = list(range(10, 22))
    assert req.run(a) == 0
    assert req.run(a) == len(a) - 1  # the whole prompt is cached, but its last token runs again
    b = a[:7] + [90, 91, 92]
    row, node, cached = req.start(b)
    assert cached == 7 and cache.match_len(b) == 7
    req.check_row(row, b, 7)  # b's row starts at a's slots: the KV of a's first 7 tokens
    req.compute(row, b, 7, 9)
    req.finish(row, node, b, 9)
    assert_owned(pool, cache)
    assert cache.device_tokens == 11 + 2  # a's 11 computed tokens, b's 2 of its own (a split node)
    assert cache.stats.hit_tokens == 11 + 7


def test_concurrent_duplicates_keep_their_own_slots_until_they_end():
    pool = make_pool(64)
    cache = RadixCache(pool)
    req = Requests(pool, cache)
    seq = list(range(30, 40))
    (r1, n1, _), (r2, n2, _) = req.start(seq), req.start(seq)
    req.compute(r1, seq, 0, 9)
    req.compute(r2, seq, 0, 9)
    n1 = cache.extend(n1, seq[:9], pool.row_slots(r1)[:9])
    n2 = cache.extend(n2, seq[:9], pool.row_slots(r2)[:9])  # the tree keeps r1's slots
    assert n1 is n2 and n1.lock == 2
    req.check_row(r2, seq, 9)
    assert pool.used_tokens == 18  # r2's copies are still in use, not freed under it
    req.finish(r2, n2, seq, 9)
    req.finish(r1, n1, seq, 9)
    assert_owned(pool, cache)
    assert cache.device_tokens == 9 and pool.free_list_tokens == 64 - 9


def test_eviction_takes_least_recently_used_leaves_and_never_locked_nodes():
    pool = make_pool(24)
    cache = RadixCache(pool)
    req = Requests(pool, cache)
    base = [1, 2, 3, 4]
    old, new = base + [5, 6, 7, 8, 0], base + [9, 10, 11, 12, 0]
    req.run(old)
    req.run(new)
    row, held, _ = req.start(base + [5, 6, 99])  # locks base + [5, 6]
    assert pool.free_tokens == 24 - 6 and cache.reclaimable == 12 - 6
    other = pool.alloc_request()
    pool.alloc_tokens(other, 16)  # 12 free, so 4 must be evicted: the LRU leaf [7, 8], then [9..12]
    remaining = {tuple(x.key) for x in cache.nodes()}
    assert (7, 8) not in remaining and cache.match_len(base + [5, 6, 0]) == 6
    assert cache.stats.evicted_tokens == 2 + 4
    pool.free_request(other)
    req.finish(row, held, base + [5, 6, 99], 6)
    assert_owned(pool, cache)


def test_host_tier_round_trip_restores_the_same_kv_and_drops_lru_copies():
    pool = make_pool(16)
    host = HostCache(pool, num_slots=20)
    cache = RadixCache(pool, host)
    req = Requests(pool, cache)
    a, b, c = [1] + list(range(40, 50)), [2] + list(range(50, 60)), [3] + list(range(60, 70))
    req.run(a)  # 10 tokens, backed up to the host at once
    assert cache.host_tokens == 10 and cache.stats.host_saved_tokens == 10
    req.run(b)  # needs 10 slots of 16: a is evicted from the device, kept on the host
    assert cache.stats.evicted_tokens == 10 and cache.match_len(a) == 10
    row, node, cached = req.start(a)  # copied back into free slots instead of recomputed
    assert cached == 10 and cache.stats.host_loaded_tokens == 10
    req.check_row(row, a, 10)
    req.finish(row, node, a, 10)
    req.run(c)  # the host holds 20: b's copy (least recently used, no longer on the device) goes
    assert cache.match_len(b) == 0 and cache.match_len(a) == 10
    assert_owned(pool, cache)


def test_prefetch_fills_free_slots_only():
    pool = make_pool(16)
    cache = RadixCache(pool, HostCache(pool, num_slots=32))
    req = Requests(pool, cache)
    a, b = [1] + list(range(40, 50)), [2] + list(range(50, 60))
    req.run(a)
    req.run(b)  # a now lives on the host only
    assert cache.prefetch(a + [7]) == 0  # 6 free-list slots: not enough, and nothing is evicted for it
    pool.free_slots(pool.take_slots(10))  # evicts b: the free list has room now
    assert cache.prefetch(a + [7]) == 10 and cache.stats.host_loaded_tokens == 10
    row, node, cached = req.start(a + [7])
    assert cached == 10 and cache.stats.host_loaded_tokens == 10  # nothing copied twice
    req.check_row(row, a, 10)
    req.finish(row, node, a + [7], 10)
    assert_owned(pool, cache)


def test_host_runs_and_plan_line():
    assert runs([4, 5, 6, 9, 3, 4]) == [(0, 4, 3), (3, 9, 1), (4, 3, 2)]
    pool = make_pool(8)
    per_token = 2 * (2 * 2 * 3 * 4) + 4 * 8
    assert kv_bytes_per_token(SPECS, torch.float32) == per_token
    tokens_, nbytes, note = host_cache_plan(per_token, 0.001)
    assert tokens_ == int(0.001 * 2**30) // per_token and nbytes == tokens_ * per_token and "--hicache-size" in note
    assert HostCache(pool, tokens_).nbytes == nbytes


def test_flags(tmp_path):
    help_text = CliRunner().invoke(cli_main, ["serve", "--help"]).output
    assert all(f in help_text for f in ("--disable-radix-cache", "--schedule-policy", "--hicache-size"))
    with pytest.raises(ConfigError, match="disable-radix-cache"):
        EngineConfig.from_kwargs(str(tmp_path), disable_radix_cache=True, hicache_size=1.0)
    with pytest.raises(ConfigError, match="schedule-policy"):
        EngineConfig.from_kwargs(str(tmp_path), schedule_policy="longest")


# ---- through the engine ----------------------------------------------------------------------------

def conversation(engine: Engine, turns: int, seed: int) -> list[tuple[list[int], int]]:
    """Each turn resends the history plus a new user message; -> (output ids, cached tokens) per turn."""
    history, out = tokens(40, seed), []
    for t in range(turns):
        history = history + tokens(5 + 3 * t, seed + 100 + t)
        result = engine.generate(input_ids=history, sampling_params=GREEDY)
        out.append((result.token_ids, result.cached_tokens))
        history = history + result.token_ids
    return out


def test_multi_turn_conversation_gives_the_same_tokens_with_and_without_the_cache(model_path):
    with Engine(model_path, **EXACT, **OFF) as eng:
        off = conversation(eng, 4, seed=1)
    with Engine(model_path, **EXACT) as eng:
        on = conversation(eng, 4, seed=1)
        assert_owned(eng.runtime.runner.kv_pool, eng.scheduler.cache)
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    assert all(c == 0 for _, c in off)
    # turn t reuses all of turn t-1's prompt and output but its last sampled token (never computed)
    lengths = [40]
    for t, (ids, _) in enumerate(on):
        lengths.append(lengths[-1] + 5 + 3 * t + len(ids))
    assert [c for _, c in on] == [0] + [n - 1 for n in lengths[1:-1]]


async def interleaved(engine: Engine) -> list[list[int]]:
    """Requests sharing two prefixes, arriving while earlier ones are still prefilling or decoding."""
    shared = [tokens(90, 7), tokens(70, 8)]
    prompts = [shared[i % 2] + tokens(3 + i, 20 + i) for i in range(8)] + [shared[0][:45] + tokens(4, 40)]

    async def one(i: int, ids: list[int]) -> list[int]:
        await asyncio.sleep(0.02 * (i % 4))
        result = await engine.async_generate(input_ids=ids, sampling_params={**GREEDY, "max_tokens": 4 + i % 3})
        return result.token_ids

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("flags", [{"chunked_prefill_size": 16}, {"chunked_prefill_size": 16, "enable_mixed_chunk": True}])
def test_interleaved_requests_sharing_prefixes(model_path, flags):
    with Engine(model_path, **{**EXACT, **flags, **OFF}) as eng:
        off = asyncio.run(interleaved(eng))
    with Engine(model_path, **{**EXACT, **flags}) as eng:
        on = asyncio.run(interleaved(eng))
        assert eng.scheduler.cache.stats.hit_tokens > 0
        assert_owned(eng.runtime.runner.kv_pool, eng.scheduler.cache)
    assert on == off


SMALL = {"max_total_tokens": 160, "chunked_prefill_size": 16}


@pytest.mark.parametrize("extra", [{}, {"hicache_size": 0.001}, {"schedule_policy": "lpm"}])
def test_a_small_pool_evicts_and_preempts_with_the_same_tokens(model_path, extra):
    with Engine(model_path, **{**EXACT, **SMALL, **OFF}) as eng:
        off = asyncio.run(interleaved(eng))
        assert eng.scheduler.preemptions > 0
    with Engine(model_path, **{**EXACT, **SMALL, **extra}) as eng:
        on = asyncio.run(interleaved(eng))
        cache = eng.scheduler.cache
        assert eng.scheduler.preemptions > 0 and cache.stats.evicted_tokens > 0
        if "hicache_size" in extra:
            assert cache.stats.host_loaded_tokens > 0
        assert_owned(eng.runtime.runner.kv_pool, cache)
    assert on == off


def test_second_request_prefills_only_its_suffix(model_path):
    prefix = tokens(300, 3)
    first, second = prefix + tokens(9, 4), prefix + tokens(12, 5)
    with Engine(model_path, **{**EXACT, "chunked_prefill_size": 128}) as eng:
        eng.generate(input_ids=first, sampling_params={**GREEDY, "max_tokens": 1})
        forward, seen = eng.runtime.runner.forward, []

        def counting(batch):
            seen.append(int(batch.extend_lens.sum()))
            return forward(batch)

        eng.runtime.runner.forward = counting
        result = eng.generate(input_ids=second, sampling_params={**GREEDY, "max_tokens": 1})
    assert result.cached_tokens == 300 and result.usage["prompt_tokens_details"] == {"cached_tokens": 300}
    assert sum(seen) == len(second) - 300


def test_load_with_random_aborts_leaks_no_slot(model_path):
    rng = random.Random(0)
    shared = [tokens(60, 50 + i) for i in range(3)]
    flags = {**EXACT, "max_total_tokens": 400, "chunked_prefill_size": 32, "max_running_requests": 6,
             "enable_mixed_chunk": True, "hicache_size": 0.0002}  # ~450 host tokens: the host tier fills too
    with Engine(model_path, **flags) as eng:
        async def one(i: int) -> None:
            ids = rng.choice(shared)[: rng.randint(20, 60)] + tokens(rng.randint(1, 30), 1000 + i)
            stop_after = rng.choice([None, 0, 1, 3])
            stream = eng.stream(input_ids=ids, sampling_params={**GREEDY, "max_tokens": rng.randint(1, 12)})
            await asyncio.sleep(rng.random() * 0.05)
            seen = 0
            async for _ in stream:
                seen += 1
                if stop_after is not None and seen > stop_after:
                    break
            await stream.aclose()

        async def load():
            await asyncio.gather(*(one(i) for i in range(40)))
            for _ in range(500):
                if eng.scheduler.num_running == 0 and eng.scheduler.num_waiting == 0:
                    return
                await asyncio.sleep(0.01)

        asyncio.run(load())
        assert eng.scheduler.num_running == 0 and eng.scheduler.num_waiting == 0
        assert eng.scheduler.cache.stats.hit_tokens > 0
        assert_owned(eng.runtime.runner.kv_pool, eng.scheduler.cache)


def test_lpm_admits_the_longest_cached_prefix_first_and_starves_no_one(model_path):
    prefix = tokens(40, 9)

    async def order(engine: Engine, n_matching: int) -> list[str]:
        done: list[str] = []

        async def run(name: str, ids: list[int], max_tokens: int = 1) -> None:
            await engine.async_generate(input_ids=ids, sampling_params={**GREEDY, "max_tokens": max_tokens})
            done.append(name)

        blocker = asyncio.ensure_future(run("blocker", tokens(5, 10), max_tokens=40))
        while engine.scheduler.num_running == 0:  # the one running slot is taken; the rest queue
            await asyncio.sleep(0.005)
        tasks = [asyncio.ensure_future(run("plain", tokens(30, 11)))]
        await asyncio.sleep(0.01)
        tasks += [asyncio.ensure_future(run(f"match{i}", prefix + tokens(2, 12 + i))) for i in range(n_matching)]
        await asyncio.gather(blocker, *tasks)
        return done[1:]

    flags = {**EXACT, "max_running_requests": 1}
    with Engine(model_path, **flags) as eng:
        eng.generate(input_ids=prefix + [5], sampling_params=GREEDY)
        assert asyncio.run(order(eng, 2)) == ["plain", "match0", "match1"]
    with Engine(model_path, **flags, schedule_policy="lpm") as eng:
        eng.generate(input_ids=prefix + [5], sampling_params=GREEDY)
        assert asyncio.run(order(eng, 2)) == ["match0", "match1", "plain"]
        got = asyncio.run(order(eng, 12))
        assert got.index("plain") == 8  # passed over by 8 admissions, then first


def test_openai_usage_reports_cached_tokens_and_metrics_the_hit_rate(model_path):
    prefix = tokens(120, 13)
    with Engine(model_path, **EXACT, served_model_name="tiny") as eng, \
            ServerThread(eng, ServerOptions(port=0)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = client.completions.create(model="tiny", prompt=prefix + [7], max_tokens=2, temperature=0.0)
        second = client.completions.create(model="tiny", prompt=prefix + [8, 9], max_tokens=2, temperature=0.0)
        stream = client.completions.create(model="tiny", prompt=prefix + [8, 9], max_tokens=2, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True})
        last = list(stream)[-1]
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 120
    assert last.usage.prompt_tokens_details.cached_tokens == 121
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line and line[0] != "#"}
    assert values["ktlite_prefix_cache_hit_tokens_total"] == 241
    assert values["ktlite_cache_hit_rate"] == pytest.approx(241 / (121 + 122 + 122))
    assert "ktlite_prefix_cache_evicted_tokens_total" in values


def test_tensor_parallel_ranks_agree_on_cached_slots(tiny_v3):
    """Rank 1 learns cached-prefix rows and host-tier copies only from rank 0's journal: TP=2 with the
    cache (and a small pool with a host tier, so slots are evicted, spilled and loaded back) must give
    the tokens of one process without the cache."""
    flags = {**EXACT, **SMALL, "max_running_requests": 4}
    with Engine(str(tiny_v3), **flags, **OFF) as eng:
        want = asyncio.run(interleaved(eng))
    with Engine(str(tiny_v3), **flags, hicache_size=0.001, tensor_parallel_size=2) as eng:
        got = asyncio.run(interleaved(eng))
        stats = eng.scheduler.cache.stats
    assert stats.hit_tokens > 0 and stats.evicted_tokens > 0 and stats.host_loaded_tokens > 0
    assert got == want
