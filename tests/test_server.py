"""The OpenAI-compatible server, live on 127.0.0.1 (ephemeral ports), against one tiny engine.

One engine for the module; three servers share it: the main one, one with --api-key and one with
a small admission limit (--max-queued-requests). Greedy requests make streamed and non-streamed
text comparable token for token.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from ktlite import Engine
from ktlite.server import ServerOptions, ServerThread
from conftest import HANG_GUARD_S

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 400, "chunked_prefill_size": 256,
                "max_running_requests": 8, "gpu_memory": "1GiB", "served_model_name": "tiny"}
GREEDY = {"temperature": 0.0, "max_tokens": 12}
MSG = [{"role": "user", "content": "Hello there, tiny model"}]
KEY = "sekret-key"


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerOptions(port=0)) as s:
        yield s


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(engine, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.runtime.runner.kv_pool.used_tokens == 0 and engine.scheduler.num_running == 0 \
                and engine.scheduler.num_waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.runtime.runner.kv_pool.used_tokens} KV tokens in use")


async def sse_lines(resp: aiohttp.ClientResponse) -> list[str]:
    """The `data:` payloads of a stream, in order, checking the framing on the way."""
    out = []
    async for raw in resp.content:
        line = raw.decode()
        assert line.endswith("\n")
        line = line.strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        out.append(line[len("data: "):])
    return out


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# ---- basics ----------------------------------------------------------------------------------
def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, body = http_get(url + "/health")
    assert status == 200 and body["status"] == "ok"


def test_openai_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert full.usage.completion_tokens <= GREEDY["max_tokens"]
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(model="tiny", messages=MSG, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_completions_stream_equals_non_stream(client):
    full = client.completions.create(model="tiny", prompt="Once upon a time", **GREEDY)
    assert full.object == "text_completion" and full.choices[0].text
    assert full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_completions_token_ids_batch_and_echo(client, engine):
    ids = engine.tokenizer.encode("Once upon a time")
    by_text = client.completions.create(model="tiny", prompt="Once upon a time", **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=["Once upon a time", "abc"], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model="tiny", prompt="Once upon a time", echo=True, **GREEDY)
    assert echoed.choices[0].text == "Once upon a time" + by_text.choices[0].text


def test_stop_strings_and_seed(client):
    base = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY).choices[0].message.content
    cut = base[len(base) // 2:][:3]
    if cut.strip():
        stopped = client.chat.completions.create(model="tiny", messages=MSG, stop=[cut, "zzzz"], **GREEDY)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == base[:base.index(cut)]
    a, b = (client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, top_p=0.9, extra_body={"top_k": 50},
                                           seed=7, max_completion_tokens=8).choices[0].message.content
            for _ in range(2))
    assert a == b


async def test_raw_sse_matches_non_streaming(url):
    body = {"model": "tiny", "messages": MSG, **GREEDY, "some_unknown_field": {"x": 1}}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            full = await r.json()
        async with s.post(url + "/v1/chat/completions",
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            lines = await sse_lines(r)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) >= 2  # token by token, not one blob
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == full["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_stream(url):
    body = json.dumps({"model": "tiny", "messages": MSG, "stream": True, **GREEDY})
    out = subprocess.run(["curl", "-sS", "-N", url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if l]
    assert lines[-1] == "data: [DONE]" and all(l.startswith("data: ") for l in lines)


async def test_twenty_concurrent_streams(url, engine):
    async def one(s: aiohttp.ClientSession, i: int) -> tuple[str, str]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"request number {i}"}], "stream": True,
                "temperature": 0.0, "max_tokens": 8}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            lines = await sse_lines(r)
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        return text, chunks[-1]["choices"][0]["finish_reason"]

    async with aiohttp.ClientSession() as s:
        results = await asyncio.wait_for(asyncio.gather(*(one(s, i) for i in range(20))), 120)
        assert all(reason in ("stop", "length") for _, reason in results)
        # batching does not change greedy text
        async with s.post(url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "request number 3"}],
                "temperature": 0.0, "max_tokens": 8}) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == results[3][0]
    wait_idle(engine)


# ---- errors ----------------------------------------------------------------------------------
LONG = "word " * 700  # > the 512-token context

ERROR_CASES = [
    # (path, raw body or json, status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 3.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": MSG, "n": 129}, 400, "n"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": 1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "presence_penalty": 9}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG, "stream": True}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", ERROR_CASES)
async def test_error_shapes(url, path, body, status, param):
    async with aiohttp.ClientSession() as s:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with s.post(url + path, **kwargs) as r:
            assert r.status == status
            assert r.headers["Content-Type"].startswith("application/json")
            err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


async def test_prompt_longer_than_kv_pool(url, engine):
    pool = engine.runtime.runner.kv_pool.num_slots
    assert pool < engine.runtime.context_length
    ids = [5] * (pool + 20)  # fits the context, not the pool
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert "KV pool" in err["message"] and err["param"] == "prompt"


async def test_unknown_route_and_method_are_json(url):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/nothing") as r:
            assert r.status == 404 and "error" in await r.json()
        async with s.get(url + "/v1/chat/completions") as r:
            assert r.status == 405 and "error" in await r.json()


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=-1)
    assert exc.value.body["param"] == "temperature"


# ---- auth, admission, disconnects, metrics ---------------------------------------------------
def test_api_key(engine):
    with ServerThread(engine, ServerOptions(port=0, api_key=KEY)) as s:
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            status, body = http_get(s.url + "/v1/models", headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=MSG, **GREEDY).choices[0].message.content
        assert http_get(s.url + "/health")[1]["status"] == "ok"  # health stays open for load balancers


async def _open_stream(s: aiohttp.ClientSession, url: str, max_tokens: int = 300) -> aiohttp.ClientResponse:
    body = {"model": "tiny", "prompt": "stream for a while", "stream": True, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}
    r = await s.post(url + "/v1/completions", json=body)
    assert r.status == 200
    await r.content.readline()  # the first chunk: the request is admitted and running
    return r


async def test_queue_full_gets_503(engine):
    # capacity = --max-running-requests (8) + --max-queued-requests (1)
    with ServerThread(engine, ServerOptions(port=0, max_queued_requests=1)) as srv:
        async with aiohttp.ClientSession() as s:
            streams = [await _open_stream(s, srv.url) for _ in range(8)]  # running
            body = {"prompt": "queued", "stream": True, "max_tokens": 2}
            streams.append(await s.post(srv.url + "/v1/completions", json=body))  # queued: headers only
            assert streams[-1].status == 200
            async with s.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}) as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
                err = (await r.json())["error"]
                assert err["code"] == "server_overloaded" and set(err) == {"message", "type", "param", "code"}
            assert engine.scheduler.num_waiting == 1
            streams.pop().close()  # a queued request whose client leaves is dropped before it runs
            deadline = time.monotonic() + HANG_GUARD_S
            while engine.scheduler.num_waiting:
                assert time.monotonic() < deadline, "queued request not aborted"
                await asyncio.sleep(0.02)
            assert engine.scheduler.num_running == 8
            for r in streams:
                r.close()  # disconnect: aborts them
    await asyncio.to_thread(wait_idle, engine)


async def test_disconnect_mid_stream_frees_kv(url, engine):
    await asyncio.to_thread(wait_idle, engine)
    async with aiohttp.ClientSession() as s:
        r = await _open_stream(s, url)
        for _ in range(6):
            await r.content.readline()
        async with s.get(url + "/metrics") as m:
            text = await m.text()
        assert metric(text, "ktlite_kv_pool_used_tokens") > 0 and metric(text, "ktlite_num_running_requests") == 1
        aborted_before = metric(text, "ktlite_aborted_requests_total")
        r.close()  # the client goes away mid-stream
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            async with s.get(url + "/metrics") as m:
                text = await m.text()
            if metric(text, "ktlite_kv_pool_used_tokens") == 0 and metric(text, "ktlite_num_running_requests") == 0:
                break
            assert time.monotonic() < deadline, "KV not freed after the client disconnected"
            await asyncio.sleep(0.05)
    assert metric(text, "ktlite_aborted_requests_total") == aborted_before + 1
    assert engine.runtime.runner.kv_pool.used_tokens == 0


async def test_metrics(url):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"messages": MSG, **GREEDY}) as r:
            assert r.status == 200
        async with s.get(url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    assert metric(text, 'ktlite_requests_total{endpoint="/v1/chat/completions",status="200"}') >= 1
    assert metric(text, 'ktlite_requests_total{endpoint="/v1/chat/completions",status="400"}') >= 1
    assert metric(text, "ktlite_prompt_tokens_total") > 0 and metric(text, "ktlite_generation_tokens_total") > 0
    assert metric(text, "ktlite_time_to_first_token_seconds_count") > 0
    assert metric(text, "ktlite_inter_token_latency_seconds_count") > 0
    assert 'ktlite_time_to_first_token_seconds_bucket{le="+Inf"}' in text
    assert metric(text, "ktlite_kv_pool_total_tokens") == 400
    for name in ("ktlite_num_waiting_requests", "ktlite_kv_pool_usage"):
        metric(text, name)


def test_message_forms_and_defaults(client, engine):
    parts = [{"type": "text", "text": "Hello there, "}, {"type": "text", "text": "tiny model"}]
    a = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], **GREEDY)
    b = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    dev = client.chat.completions.create(model="default", messages=[{"role": "developer", "content": "Be brief."}, *MSG],
                                         user="u1", **GREEDY)
    assert dev.model == "tiny" and dev.usage.prompt_tokens > b.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    # completions default to 16 tokens, like OpenAI's legacy API
    c = client.completions.create(model="tiny", prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 16 and c.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, stream=True, **GREEDY))
    assert all(c.usage is None for c in chunks)  # no usage chunk unless stream_options asks for it


async def test_internal_errors_are_json_not_hangs(url, engine, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("kaboom")
        yield  # pragma: no cover

    monkeypatch.setattr(engine, "stream_ids", broken)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"messages": MSG, **GREEDY}) as r:
            assert r.status == 500
            err = (await r.json())["error"]
            assert err["type"] == "server_error" and "kaboom" in err["message"]
        async with s.post(url + "/v1/chat/completions", json={"messages": MSG, "stream": True, **GREEDY}) as r:
            lines = await asyncio.wait_for(sse_lines(r), 30)
    assert lines[-1] == "[DONE]" and "kaboom" in json.loads(lines[-2])["error"]["message"]
