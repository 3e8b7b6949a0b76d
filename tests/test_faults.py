"""Fault tests on the tiny model: disconnects, aborts while queued, admission bursts, KV and context
edges, graceful shutdown of a real server process. Every loop is bounded in count and time.

Engine "small": 4 request rows and a 96-token KV pool under a 128-token context, so a few streams
already force preemption, and a prompt can exactly fill the pool.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from ktlite import Engine
from ktlite.server import ServerOptions, ServerThread
from conftest import HANG_GUARD_S, STARTUP_GUARD_S
from test_server import metric

SMALL = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 96, "context_length": 128,
         "chunked_prefill_size": 32, "max_running_requests": 4, "gpu_memory": "1GiB", "served_model_name": "tiny"}
CTX = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 256, "context_length": 64,
       "chunked_prefill_size": 32, "max_running_requests": 4, "gpu_memory": "1GiB", "served_model_name": "tiny"}
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **SMALL) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerOptions(port=0)) as s:
        yield s


def idle(engine, server=None) -> bool:
    pool = engine.runtime.runner.kv_pool
    return (pool.used_tokens == 0 and pool.free_tokens == pool.num_slots and engine.scheduler.num_running == 0
            and engine.scheduler.num_waiting == 0 and (server is None or server.server.metrics.in_flight == 0))


async def wait_idle(engine, server=None, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not idle(engine, server):
        assert time.monotonic() < deadline, (
            f"not idle: {engine.runtime.runner.kv_pool.used_tokens} KV tokens used, "
            f"{engine.scheduler.num_running} running, {engine.scheduler.num_waiting} waiting")
        await asyncio.sleep(0.02)


async def sse(resp: aiohttp.ClientResponse) -> list[str]:
    out = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line:
            assert line.startswith("data: "), line
            out.append(line[6:])
    return out


async def greedy_text(s: aiohttp.ClientSession, url: str, prompt: str = "a reference prompt") -> str:
    async with s.post(url + "/v1/completions", json={"prompt": prompt, **GREEDY}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


# ---- disconnects -------------------------------------------------------------------------------
N_DISCONNECT = 40


async def test_random_disconnects_lose_nothing(engine, server):
    """40 streams, each cut at a random point (before the response, after k chunks, or never),
    with more streams than request rows so some are cut while queued and some while preempted."""
    rng = random.Random(1234)
    url = server.url
    async with aiohttp.ClientSession() as s:
        reference = await greedy_text(s, url)

        async def one(i: int) -> str:
            cut = rng.choice(["before", "chunks", "chunks", "never"])
            k = rng.randrange(1, 12)
            body = {"prompt": f"stream number {i} " * rng.randrange(1, 5), "stream": True, "temperature": 0.0,
                    "max_tokens": rng.randrange(8, 40), "ignore_eos": True}
            if cut == "before":  # the client gives up before any byte comes back
                task = asyncio.create_task(s.post(url + "/v1/completions", json=body))
                await asyncio.sleep(rng.random() * 0.3)
                task.cancel()
                try:
                    r = await task
                    r.close()
                except asyncio.CancelledError:
                    pass
                return "cut"
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                if cut == "chunks":
                    for _ in range(k):
                        if not await r.content.readline():
                            break
                    r.close()
                    return "cut"
                lines = await sse(r)
            assert lines[-1] == "[DONE]"
            final = json.loads(lines[-2])["choices"][0]
            assert final["finish_reason"] == "length"
            return "completed"

        outcomes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(N_DISCONNECT))), 120)
        await wait_idle(engine, server)
        assert outcomes.count("completed") >= 1 and outcomes.count("cut") >= 10
        print(f"\n{N_DISCONNECT} streams: {outcomes.count('cut')} cut by the client, {outcomes.count('completed')} "
              f"completed; preemptions so far {engine.scheduler.preemptions}")
        assert await greedy_text(s, url) == reference  # nothing leaked into later requests
    await wait_idle(engine, server)


async def test_abort_while_queued(engine, server):
    url = server.url
    body = {"prompt": "long running", "stream": True, "temperature": 0.0, "max_tokens": 100, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        running = []
        for _ in range(SMALL["max_running_requests"]):
            r = await s.post(url + "/v1/completions", json={**body, "max_tokens": 20})
            await r.content.readline()
            running.append(r)
        queued = [await s.post(url + "/v1/completions", json=body) for _ in range(5)]
        deadline = time.monotonic() + HANG_GUARD_S
        while engine.scheduler.num_waiting < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        for r in queued:
            r.close()  # leave while queued: they are dropped without ever running to the end
        for r in running:  # the running ones still finish normally
            lines = await asyncio.wait_for(sse(r), 60)
            assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
    await wait_idle(engine, server)


# ---- admission -----------------------------------------------------------------------------------
async def test_burst_beyond_max_queued_requests(engine):
    """capacity = 4 running + 4 queued; 40 requests at once: the excess gets 503, the rest complete."""
    with ServerThread(engine, ServerOptions(port=0, max_queued_requests=4)) as srv:
        async with aiohttp.ClientSession() as s:
            async def one(i: int):
                stream = i % 2 == 0
                body = {"prompt": f"burst {i}", "stream": stream, **GREEDY}
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    if r.status == 503:
                        err = (await r.json())["error"]
                        assert err["code"] == "server_overloaded" and int(r.headers["Retry-After"]) >= 1
                        return "503"
                    assert r.status == 200
                    if stream:
                        lines = await sse(r)
                        assert lines[-1] == "[DONE]"
                        reason = json.loads(lines[-2])["choices"][0]["finish_reason"]
                    else:
                        reason = (await r.json())["choices"][0]["finish_reason"]
                    assert reason == "length"
                    return "ok"

            outcomes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 120)
        print(f"\nburst of 40 at capacity 8: {outcomes.count('ok')} completed, {outcomes.count('503')} got 503")
        assert outcomes.count("503") >= 1 and outcomes.count("ok") >= 8
        assert outcomes.count("ok") + outcomes.count("503") == 40
    await wait_idle(engine)


# ---- KV pool and context edges --------------------------------------------------------------------
async def test_prompt_exactly_fills_kv_pool(engine, server):
    slots = engine.runtime.runner.kv_pool.num_slots
    assert slots < engine.runtime.context_length
    async with aiohttp.ClientSession() as s:
        # slots - 1 prompt tokens: prefill fills all but one slot, the first decode takes the last one
        async with s.post(server.url + "/v1/completions",
                          json={"prompt": [7] * (slots - 1), "max_tokens": 10, "temperature": 0.0,
                                "ignore_eos": True}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == slots - 1
        assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == slots + 1  # pool + 1 sampled
        # the same, streamed, with other requests competing for the pool
        async def small(i):
            async with s.post(server.url + "/v1/completions", json={"prompt": f"competitor {i}", **GREEDY}) as r:
                assert r.status == 200
                return (await r.json())["choices"][0]["finish_reason"]

        async def big():
            async with s.post(server.url + "/v1/completions",
                              json={"prompt": [7] * (slots - 1), "max_tokens": 10, "temperature": 0.0,
                                    "ignore_eos": True, "stream": True}) as r:
                lines = await sse(r)
            assert lines[-1] == "[DONE]"
            return json.loads(lines[-2])["choices"][0]["finish_reason"]

        reasons = await asyncio.wait_for(asyncio.gather(big(), *(small(i) for i in range(3))), 60)
        assert reasons == ["length"] * 4
        # slots tokens: cannot fit with even one token to generate
        async with s.post(server.url + "/v1/completions", json={"prompt": [7] * slots, "max_tokens": 1}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert "KV pool" in err["message"] and err["param"] == "prompt"
    await wait_idle(engine, server)


async def test_max_tokens_reaching_context_limit(tiny_v3):
    with Engine(str(tiny_v3), **CTX) as eng, ServerThread(eng, ServerOptions(port=0)) as srv:
        ctx = eng.runtime.context_length
        assert ctx == 64
        p = 20
        async with aiohttp.ClientSession() as s:
            base = {"prompt": [9] * p, "temperature": 0.0, "ignore_eos": True}
            async with s.post(srv.url + "/v1/completions", json={**base, "max_tokens": ctx - p}) as r:
                assert r.status == 200
                out = await r.json()
            assert out["usage"]["completion_tokens"] == ctx - p and out["choices"][0]["finish_reason"] == "length"
            async with s.post(srv.url + "/v1/completions", json={**base, "max_tokens": ctx - p, "stream": True,
                                                                 "stream_options": {"include_usage": True}}) as r:
                lines = await sse(r)
            assert lines[-1] == "[DONE]" and json.loads(lines[-2])["usage"]["completion_tokens"] == ctx - p
            async with s.post(srv.url + "/v1/completions", json={**base, "max_tokens": ctx - p + 1}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "context_length_exceeded"
            # chat without max_tokens runs to the end of the context
            async with s.post(srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "ignore_eos": True}) as r:
                assert r.status == 200
                out = await r.json()
            assert out["usage"]["total_tokens"] == ctx and out["choices"][0]["finish_reason"] == "length"
        await wait_idle(eng)


# ---- graceful shutdown ------------------------------------------------------------------------------
def _start_server(tiny_v3, tmp_path) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "ktlite.launch_server", "--model", str(tiny_v3), "--kt-method", "BF16",
            "--max-total-tokens", "1024", "--chunked-prefill-size", "256", "--gpu-memory", "1GiB",
            "--max-running-requests", "2", "--host", "127.0.0.1", "--port", "0", "--skip-server-warmup"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.stderr", "w"), text=True)
    deadline = time.monotonic() + STARTUP_GUARD_S
    for line in proc.stdout:  # ends when the process does
        m = re.search(r"ktlite listening on (http://\S+:\d+)", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"server did not start: {(tmp_path / 'serve.stderr').read_text()[-3000:]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_graceful_shutdown_ends_streams(tiny_v3, tmp_path, sig):
    proc, url = await asyncio.to_thread(_start_server, tiny_v3, tmp_path)
    port = int(url.rsplit(":", 1)[1])
    try:
        body = {"prompt": "keep streaming", "stream": True, "temperature": 0.0, "max_tokens": 400,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            streams = []
            for _ in range(2):  # the two request rows: running
                r = await s.post(url + "/v1/completions", json=body)
                assert r.status == 200
                await r.content.readline()
                streams.append(r)
            streams.append(await s.post(url + "/v1/completions", json=body))  # queued
            blocking = asyncio.create_task(s.post(url + "/v1/completions", json={**body, "stream": False}))
            deadline = time.monotonic() + HANG_GUARD_S
            while True:  # signal once the server holds all four (not after a guessed delay: CI machines differ)
                async with s.get(url + "/metrics") as m:
                    if metric(await m.text(), "ktlite_num_in_flight_requests") == 4:
                        break
                assert time.monotonic() < deadline, "the server never accepted the fourth request"
                await asyncio.sleep(0.02)
            proc.send_signal(sig)
            for r in streams:
                lines = await asyncio.wait_for(sse(r), 30)
                assert lines[-1] == "[DONE]", lines[-3:]
                last = json.loads(lines[-2])
                # an error event naming the abort, or a final chunk with a finish_reason
                assert last.get("error", {}).get("code") == "aborted" or last["choices"][0]["finish_reason"], last
            r = await asyncio.wait_for(blocking, 30)
            assert r.status == 503 and (await r.json())["error"]["code"] == "aborted"
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0
        with socket.socket() as sock:  # the port is released: nothing listens (as a restarted server binds it,
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the closed streams' TIME_WAIT)
            sock.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_forward_error_ends_every_request_with_it(tiny_v3, monkeypatch):
    """A forward step that raises stops the scheduler: the requests in flight, and any sent later, get an
    EngineFailure naming the error, instead of waiting forever for a loop that no longer runs."""
    from ktlite.errors import EngineFailure

    with Engine(str(tiny_v3), **SMALL) as eng:
        def broken(batch):
            raise RuntimeError("a kernel failed")

        monkeypatch.setattr(eng.runtime.runner, "forward", broken)
        started = time.monotonic()
        with pytest.raises(EngineFailure, match="a kernel failed"):
            eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY)
        with pytest.raises(EngineFailure, match="a kernel failed"):
            eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        assert time.monotonic() - started < HANG_GUARD_S
        monkeypatch.undo()
