"""Bad input: property-based fuzzing (hypothesis) of the HTTP API against its OpenAPI description.

Request bodies are drawn from the schemas served at /openapi.json (`ktlite/server/openapi.py`),
each field either schema-conforming or replaced by arbitrary JSON of any type; raw bytes bodies
(non-UTF-8, truncated JSON, deep nesting) and random headers are fuzzed too. The property: every
response comes back within a bound, is never a 5xx, errors are OpenAI's JSON shape, and streams end
with `data: [DONE]`. The engine's context is 64 tokens, so any accepted request is short.
Examples are bounded (FUZZ_EXAMPLES in all) and derandomized, so CI runs the same cases each time.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import HANG_GUARD_S
from ktlite import Engine
from ktlite.server import ServerOptions, ServerThread
from ktlite.server.openapi import OPENAPI, openapi

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 256, "context_length": 64,
                "chunked_prefill_size": 64, "max_running_requests": 8, "gpu_memory": "1GiB",
                "served_model_name": "tiny"}
MAX_BYTES = 64 * 1024
TIMEOUT_S = HANG_GUARD_S
EXAMPLES = {"chat": 200, "completion": 150, "responses": 60, "raw": 100, "headers": 60}
FUZZ_EXAMPLES = sum(EXAMPLES.values())
SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
OK_STATUSES = {200, 400, 404, 405, 413}
SCHEMAS = OPENAPI["components"]["schemas"]
COUNTS: dict[int, int] = {}  # responses by status, printed at the end
PARAMS: dict[str, int] = {}  # 4xx by the parameter named


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerOptions(port=0, max_request_bytes=MAX_BYTES)) as s:
        yield s


# ---- strategies from the OpenAPI schemas ---------------------------------------------------------
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def mostly(usual: st.SearchStrategy, odd: st.SearchStrategy, odds: int) -> st.SearchStrategy:
    """`usual` about odds times in odds + 1, else `odd` (one_of would merge repeated branches)."""
    return st.integers(0, odds).flatmap(lambda k: odd if k == 0 else usual)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy:
    """A strategy for (a loose superset of) the values a JSON schema describes: bounds are not
    respected on purpose (out-of-range numbers are the point), types and shapes are."""
    if "examples" in schema:  # the documented examples often, so bodies get past the first check
        rest = {k: v for k, v in schema.items() if k != "examples"}
        return st.sampled_from(schema["examples"]) | from_schema(rest)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s) for s in schema["anyOf"]))
    if "enum" in schema:
        return mostly(st.sampled_from(schema["enum"]), TEXT, 10)
    types = schema.get("type", "object")
    if isinstance(types, list):
        return st.one_of(*(from_schema({**schema, "type": t}) for t in types))
    if types == "null":
        return st.none()
    if types == "boolean":
        return st.booleans()
    if types == "integer":
        return st.integers(-3, 80) | st.integers(-(2**64), 2**64)
    if types == "number":
        return st.floats(-3, 3) | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
    if types == "string":
        return TEXT
    if types == "array":
        items = from_schema(schema.get("items", {"type": "string"}))
        most = schema.get("maxItems", 6)
        return mostly(st.lists(items, min_size=schema.get("minItems", 0), max_size=most),
                      st.lists(items, max_size=most), 6)
    props = schema.get("properties", {})
    required = set(schema.get("required", []))

    def field(s: dict[str, Any]) -> st.SearchStrategy:
        return mostly(from_schema(s), JUNK, 10)  # mostly well-typed, sometimes anything

    return st.fixed_dictionaries({k: field(v) for k, v in props.items() if k in required},
                                 optional={k: field(v) for k, v in props.items() if k not in required})


def body_strategy(name: str) -> st.SearchStrategy:
    s = from_schema(SCHEMAS[name])
    return mostly(s, JUNK, 8)  # sometimes not even an object


# ---- one request, checked ----------------------------------------------------------------------------
def request(url: str, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, dict, bytes]:
    u = urlparse(url)
    assert u.hostname == "127.0.0.1"
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
    try:
        t0 = time.monotonic()
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        assert time.monotonic() - t0 < TIMEOUT_S
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def check(status: int, headers: dict[str, str], data: bytes) -> None:
    COUNTS[status] = COUNTS.get(status, 0) + 1
    assert status in OK_STATUSES, (status, data[:500])
    if status != 200:
        assert headers.get("content-type", "").startswith("application/json"), headers
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        PARAMS[str(err["param"]).split("[")[0]] = PARAMS.get(str(err["param"]).split("[")[0], 0) + 1
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        lines = [l for l in data.decode().split("\n") if l]
        if lines[0].startswith("event: "):  # the Responses API: named events, no [DONE]
            assert lines[-2] in ("event: response.completed", "event: response.incomplete"), lines[-2:]
            return
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            obj = json.loads(line[len("data: "):])
            assert "error" not in obj, obj
        return
    obj = json.loads(data)
    if obj.get("object") == "response":
        assert obj["status"] in ("completed", "incomplete") and obj["usage"]["output_tokens"] >= 1
        return
    assert obj["choices"] and obj["usage"]["completion_tokens"] >= 1


def post_json(server, path: str, value: Any, headers: dict[str, str] | None = None):
    raw = json.dumps(value, allow_nan=True).encode()
    status, hdrs, data = request(server.url, "POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
    check(status, hdrs, data)
    return status, data


# ---- the fuzz tests ----------------------------------------------------------------------------------
def test_openapi_json_is_served(server):
    status, headers, data = request(server.url, "GET", "/openapi.json", None, {})
    assert status == 200 and headers["content-type"].startswith("application/json")
    doc = json.loads(data)
    assert doc == openapi() and doc["openapi"].startswith("3.")
    routes = {r.resource.canonical for r in server.server.app().router.routes()}
    assert set(doc["paths"]) == routes  # every route is described, nothing else


@settings(max_examples=EXAMPLES["chat"], **SETTINGS)
@given(body=body_strategy("ChatCompletionRequest"))
def test_fuzz_chat_completions(server, body):
    post_json(server, "/v1/chat/completions", body)


@settings(max_examples=EXAMPLES["completion"], **SETTINGS)
@given(body=body_strategy("CompletionRequest"))
def test_fuzz_completions(server, body):
    post_json(server, "/v1/completions", body)


RAW = st.one_of(
    st.binary(max_size=200),
    TEXT.map(lambda t: t.encode("utf-16")),
    st.binary(min_size=1, max_size=50).map(lambda b: b'{"messages": [{"role": "user", "content": "' + b + b'"}]}'),
    st.integers(1, 50).map(lambda n: json.dumps({"messages": [{"role": "user", "content": "hi"}]})[:n].encode()),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from([b"", b"null", b"NaN", b"1e999", b"\xff\xfe", b'{"messages": NaN}', b"\x00" * 10]),
)


@settings(max_examples=EXAMPLES["responses"], **SETTINGS)
@given(body=body_strategy("ResponsesRequest"))
def test_fuzz_responses(server, body):
    post_json(server, "/v1/responses", body)


@settings(max_examples=EXAMPLES["raw"], **SETTINGS)
@given(raw=RAW, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]))
def test_fuzz_raw_bodies(server, raw, path):
    status, headers, data = request(server.url, "POST", path, raw, {"Content-Type": "application/json"})
    check(status, headers, data)


HEADER_NAME = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-0123456789XYZ"), min_size=1, max_size=20).filter(
    lambda n: n.lower() not in ("content-length", "transfer-encoding", "host", "connection", "expect",
                                "content-encoding", "upgrade"))
HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)


@settings(max_examples=EXAMPLES["headers"], **SETTINGS)
@given(headers=st.dictionaries(HEADER_NAME, HEADER_VALUE, max_size=6),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x", "application/json; charset=latin-1"]),
       auth=st.one_of(st.none(), HEADER_VALUE),
       method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/x", "/health",
                             "/v1/x", "/openapi.json"]))
def test_fuzz_headers_and_methods(server, headers, content_type, auth, method, path):
    hdrs = dict(headers)
    if content_type:
        hdrs["Content-Type"] = content_type
    if auth is not None:
        hdrs["Authorization"] = auth
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 2}).encode()
    status, rheaders, data = request(server.url, method, path, body if method != "GET" else None, hdrs)
    if path in ("/v1/models", "/v1/models/x", "/health", "/openapi.json") and status == 200:
        json.loads(data)
        return
    check(status, rheaders, data)


# ---- explicit cases ----------------------------------------------------------------------------------
def test_non_utf8_body_is_400(server):
    for raw in (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', b"\xff\xfe{}", "{}".encode("utf-16")):
        status, headers, data = request(server.url, "POST", "/v1/chat/completions", raw,
                                        {"Content-Type": "application/json"})
        assert status == 400, data
        err = json.loads(data)["error"]
        assert err["code"] == "invalid_encoding" and "UTF-8" in err["message"]


def test_huge_body_is_413(server):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (MAX_BYTES + 10)}]}).encode()
    for path in ("/v1/chat/completions", "/v1/completions"):
        status, headers, data = request(server.url, "POST", path, big, {"Content-Type": "application/json"})
        assert status == 413, data[:200]
        err = json.loads(data)["error"]
        assert err["code"] == "request_too_large" and str(MAX_BYTES) in err["message"]
    # just under the limit is parsed (and rejected for its content, not its size)
    ok = json.dumps({"messages": [{"role": "user", "content": "x" * (MAX_BYTES - 100)}]}).encode()
    assert len(ok) <= MAX_BYTES
    status, _, data = request(server.url, "POST", "/v1/chat/completions", ok, {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded"


def test_serve_has_max_request_bytes_option():
    from click.testing import CliRunner

    from ktlite.cli import main

    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--max-request-bytes" in out


def test_deeply_nested_json_is_400(server):
    for raw in (b"[" * 20_000 + b"]" * 20_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
        status, _, data = request(server.url, "POST", "/v1/chat/completions", raw, {"Content-Type": "application/json"})
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_json"


def test_server_healthy_and_idle_after_fuzzing(server, engine):
    deadline = time.monotonic() + HANG_GUARD_S
    pool = engine.runtime.runner.kv_pool
    while pool.used_tokens or engine.scheduler.num_running or engine.scheduler.num_waiting:
        assert time.monotonic() < deadline, "KV not freed after fuzzing"
        time.sleep(0.02)
    status, _, data = request(server.url, "GET", "/health", None, {})
    assert status == 200
    status, headers, data = request(server.url, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode(), {"Content-Type": "application/json"})
    assert status == 200
    print(f"\nfuzz: {sum(COUNTS.values())} requests checked, by status {dict(sorted(COUNTS.items()))}; "
          f"4xx by param {dict(sorted(PARAMS.items(), key=lambda kv: -kv[1]))}")
