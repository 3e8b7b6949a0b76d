"""Anthropic's Messages API through the official `anthropic` SDK (and raw SSE for the event order):
text and streamed replies, a tool_use round trip, thinking, stop sequences, count_tokens, errors
and x-api-key auth. The model is the tiny random one with a template that renders tools, tool
results and a thinking switch (tests/chat_templates.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest
from chat_templates import MAPPING, with_template

from ktlite import Engine
from ktlite.runtime.sampling import SamplingParams
from ktlite.runtime.scheduler import StreamEvent
from ktlite.server import ServerOptions, ServerThread
from ktlite.server.anthropic import MessageStream
from ktlite.server.chat_output import OutputPlan
from ktlite.server.protocol import ParsedRequest
from ktlite.server.reasoning import split_reasoning

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 1024,
                "max_running_requests": 8, "gpu_memory": "1GiB", "served_model_name": "tiny"}
KEY = "anthropic-test-key"
GREEDY = {"temperature": 0.0}  # this SDK version has no temperature argument; the server takes it
USER = [{"role": "user", "content": "Hello there, tiny model"}]
TOOL = {"name": "set_light", "description": "Switch a light.",
        "input_schema": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                          "room": {"enum": ["kitchen", "hall"]}},
                         "required": ["on", "room"], "additionalProperties": False}}


def post(url: str, body: dict | bytes, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """-> (status, content type, body) of a raw POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers["content-type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["content-type"], exc.read()


@pytest.fixture(scope="module")
def engine(tiny_v3, tmp_path_factory):
    model = with_template(tiny_v3, tmp_path_factory.mktemp("anthropic") / "m", MAPPING, context=2048)
    with Engine(str(model), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerOptions(port=0, tool_call_parser="qwen3_coder", reasoning_parser="qwen3")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_text_reply(client):
    m = client.messages.create(model="tiny", max_tokens=12, messages=USER, system="Be brief.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.output_tokens <= 12
    count = client.messages.count_tokens(model="tiny", messages=USER, system="Be brief.").input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count


def test_stream_equals_non_stream(client):
    whole = client.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)
    with client.messages.stream(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_event_sequence(server):
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, "stream": True, "temperature": 0.0}
    status, kind, raw = post(server.url + "/v1/messages", body)
    assert status == 200 and kind.startswith("text/event-stream")
    lines = [line for line in raw.decode().split("\n") if line]
    events = [(lines[i][len("event: "):], json.loads(lines[i + 1][len("data: "):])) for i in range(0, len(lines), 2)]
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 8


def test_tool_use_round_trip(client):
    m = client.messages.create(model="tiny", max_tokens=80, messages=USER, tools=[TOOL],
                               tool_choice={"type": "any"})  # sampled (temperature 1)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "set_light" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, TOOL["input_schema"])
    follow = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "the light is on"}]}]
    reply = client.messages.create(model="tiny", max_tokens=8, messages=follow, tools=[TOOL], extra_body=GREEDY)
    assert reply.content[0].type == "text"
    count = client.messages.count_tokens(model="tiny", messages=follow, tools=[TOOL]).input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == count
    shorter = [*follow[:-1], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": ""}]}]
    assert client.messages.count_tokens(model="tiny", messages=shorter, tools=[TOOL]).input_tokens < count


def test_streamed_named_tool(client):
    with client.messages.stream(model="tiny", max_tokens=80, messages=USER, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "set_light"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, TOOL["input_schema"])


def test_thinking_block(client, server):
    """thinking enabled: the template opens <think> in the prompt, so the reply is thinking until
    </think>; the split equals the reasoning parser's on the raw text (the OpenAI route, unsplit)."""
    _, _, reply = post(server.url + "/v1/chat/completions", {
        "model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0.0, "separate_reasoning": False,
        "chat_template_kwargs": {"thinking": True, "enable_thinking": True}})
    raw = json.loads(reply)["choices"][0]["message"]["content"]
    reasoning, content = split_reasoning("qwen3", raw, prompt_opens_think=True)
    enabled = {"model": "tiny", "max_tokens": 12, "messages": USER, "extra_body": GREEDY,
               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    on = client.messages.create(**enabled)
    expected = [{"type": "thinking", "thinking": reasoning, "signature": ""}] + \
        ([{"type": "text", "text": content}] if content else [])
    assert [b.model_dump(exclude_none=True) for b in on.content] == expected and reasoning
    with client.messages.stream(**enabled) as stream:
        assert [b.model_dump(exclude_none=True) for b in stream.get_final_message().content] == expected
    off = client.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_stop_sequence(client):
    text = client.messages.create(model="tiny", max_tokens=16, messages=USER, extra_body=GREEDY).content[0].text
    stop = text[5:8]
    assert stop.strip()
    m = client.messages.create(model="tiny", max_tokens=16, messages=USER, extra_body=GREEDY, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_errors_are_anthropic_shaped(server, client):
    for body in ({"model": "tiny", "messages": USER},  # no max_tokens
                 {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
                 {"model": "tiny", "max_tokens": 4, "messages": []},
                 {"model": "tiny", "max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}},
                 b"{not json"):
        status, kind, raw = post(server.url + "/v1/messages", body)
        err = json.loads(raw)
        assert status == 400 and kind.startswith("application/json") and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "developer", "content": "x"}])
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert exc.value.body == {"type": "error", "error": {"type": "not_found_error", "message": exc.value.body[
        "error"]["message"]}}


def test_x_api_key(engine):
    with ServerThread(engine, ServerOptions(port=0, api_key=KEY)) as s:
        with pytest.raises(anthropic.AuthenticationError) as exc:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=USER)
        assert exc.value.body["error"]["type"] == "authentication_error"
        m = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=USER)
        assert m.usage.output_tokens == 2


def test_message_stream_blocks():
    """Thinking, text and two tool calls in model text become well-formed blocks, each opened, filled
    and closed in order, a signature before the thinking block closes, stop_reason tool_use."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    req = ParsedRequest("messages", "tiny", [[1]], SamplingParams(), True, False, "max_tokens", True,
                        output=OutputPlan("qwen3", False, "qwen3_coder", tools, id_prefix="toolu_"),
                        request_id="msg_x")
    text = ("<think>hm</think>Ok.<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call>")
    s = MessageStream(req, lambda ids, reason: None)
    frames = []
    for i in range(0, len(text), 4):
        frames += s.event(StreamEvent(text[i:i + 4], [7], None, 5, 0, 2))
    frames += s.end(StreamEvent("", [], "stop", 5, 9, 2))
    names = [n for n, _ in frames]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [(i, d) for i, (n, d) in enumerate(frames) if n == "content_block_start"]
    stops = [i for i, (n, _) in enumerate(frames) if n == "content_block_stop"]
    assert [d["index"] for _, d in starts] == [0, 1, 2, 3] and len(stops) == 4
    assert [d["content_block"]["type"] for _, d in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert all(start < stop < next_start for (start, _), stop, (next_start, _) in zip(starts, stops, starts[1:]))
    assert frames[stops[0] - 1][1]["delta"] == {"type": "signature_delta", "signature": ""}
    deltas = [d["delta"] for n, d in frames if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "hm" and "".join(d.get("text", "") for d in deltas) == "Ok."
    assert [json.loads(d["partial_json"]) for d in deltas if d["type"] == "input_json_delta"] == [{"a": 1}, {}]
    assert starts[2][1]["content_block"]["id"].startswith("toolu_")
    assert frames[0][1]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 2,
                                                "cache_creation_input_tokens": 0}
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"
