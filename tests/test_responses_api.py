"""OpenAI's Responses API through the official `openai` SDK (`client.responses.create/stream`, whose
stream parser checks the event order), and Codex CLI's recorded requests replayed through the route.

tests/data/agents/codex/ holds request bodies recorded from the real Codex CLI (0.171.0, see the README
there): turn 1, turn 1 after its `exec_command` call ran (function_call + function_call_output),
turn 2 (`codex exec resume --last`), and a turn 1 after a call that ktlite's own frames carried
(Codex sends back our reasoning, message and function_call items). They carry what current Codex sends: `store: false` with the
whole history every turn, `developer` messages instead of `instructions`, `include`,
`prompt_cache_key`, `client_metadata`, `reasoning.summary`, 7 function tools, a `namespace` tool and a
hosted `web_search` tool. Every body is parsed verbatim; their ~19k-token prompts (in the tiny model's
1024-token vocabulary) take minutes to prefill on a CPU, so the replay over HTTP cuts their long texts
(`_shrunk`: the same items, fields and prefix relations between turns) and caps the output.

The model is the tiny random one with a template that renders tools, calls, tool results and a
thinking switch (tests/chat_templates.py). Its replies end at max_output_tokens (status "incomplete"),
so the tests that need a completed response end it with a stop string taken from its greedy text
(`stop`, an SGLang extra the route accepts) or force a tool call.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import jsonschema
import openai
import pytest
from chat_templates import MAPPING, with_template
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from ktlite import Engine
from ktlite.runtime.sampling import SamplingParams
from ktlite.runtime.scheduler import StreamEvent
from ktlite.server import responses as R
from ktlite.server.chat_output import OutputPlan
from test_anthropic_api import post
from test_claude_code import PARSERS, _load, server  # noqa: F401 - server: the fixture, on this module's engine

CORPUS = Path(__file__).parent / "data" / "agents" / "codex"
BODIES = sorted(CORPUS.glob("*.json"))
CONTEXT = 32768  # the verbatim bodies render to ~19k tokens
ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 8192, "chunked_prefill_size": 2048,
                "max_running_requests": 4, "gpu_memory": "1GiB", "served_model_name": "tiny"}
GREEDY = {"temperature": 0.0}
CUT = 120  # characters kept of each long text in the replay
TOOL = {"type": "function", "name": "set_light", "description": "Switch a light.",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                        "room": {"enum": ["kitchen", "hall"]}},
                       "required": ["on", "room"], "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def _shrunk(body: dict) -> dict:
    """The body with long texts cut to CUT characters, tool descriptions dropped and the output capped:
    deterministic, so consecutive turns keep their common prefix."""
    body = copy.deepcopy(body)
    body["max_output_tokens"] = 4
    body["temperature"] = 0.0
    for item in body["input"]:
        if isinstance(item.get("content"), list):
            for part in item["content"]:
                part["text"] = part["text"][:CUT]
        if isinstance(item.get("output"), str):
            item["output"] = item["output"][:CUT]
    for tool in body["tools"]:
        for t in [tool, *tool.get("tools", [])]:
            t.pop("description", None)
    return body


@pytest.fixture(scope="module")
def engine(tiny_v3, tmp_path_factory):
    model = with_template(tiny_v3, tmp_path_factory.mktemp("responses") / "m", MAPPING, context=CONTEXT)
    with Engine(str(model), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stop_after(client, n: int, **kwargs) -> str:
    """A stop string that ends the greedy reply after about n characters of its first item's text (so
    it completes)."""
    text = client.responses.create(model="tiny", max_output_tokens=12, extra_body=GREEDY, **kwargs).output[0].content[0].text
    stop = text[n:n + 3]
    assert stop.strip() and text.index(stop) > 0, text
    return stop


# ---- the SDK ---------------------------------------------------------------------------------------
def test_text_reply(client):
    r = client.responses.create(model="tiny", input="Hello there, tiny model", instructions="Be brief.",
                                max_output_tokens=6, extra_body=GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.instructions == "Be brief." and r.max_output_tokens == 6
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    bare = client.responses.create(model="tiny", input="Hello there, tiny model", max_output_tokens=6,
                                   extra_body=GREEDY)
    assert bare.usage.input_tokens < r.usage.input_tokens  # the instructions are a system message


def test_stream_event_order(client):
    """The SDK's stream parser accepts the events (it checks identities and order) and rebuilds the
    same response the non-streamed call returns."""
    stop = _stop_after(client, 6, input="Hello there")
    args = {"model": "tiny", "input": "Hello there", "max_output_tokens": 12, "extra_body": {**GREEDY, "stop": [stop]}}
    whole = client.responses.create(**args)
    assert whole.status == "completed" and whole.incomplete_details is None
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == TEXT_EVENTS[:4] + ["response.output_text.delta"] * deltas + TEXT_EVENTS[5:]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_incomplete_stream(server):
    status, _, raw = post(server.url + "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 3,
                                                         "stream": True})
    events = _events(raw, status)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_function_call_round_trip(client):
    """A forced call (grammar) is a function_call item; its output goes back as function_call_output."""
    r = client.responses.create(model="tiny", input="Light the kitchen", tools=[TOOL], tool_choice="required",
                                max_output_tokens=80)
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "set_light" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    follow = [{"role": "user", "content": "Light the kitchen"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "the light is on"}]
    reply = client.responses.create(model="tiny", input=follow, tools=[TOOL], max_output_tokens=4,
                                    extra_body=GREEDY)
    assert reply.output[0].type == "message"
    assert reply.usage.input_tokens > r.usage.input_tokens
    with client.responses.stream(model="tiny", input="Light the hall", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "set_light"}, max_output_tokens=80) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["function_call"]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall"]}}, "required": ["room"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Which room?", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "room", "schema": schema}})
    assert r.status == "completed" and [o.type for o in r.output] == ["message"]
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id(client):
    """Stored responses chain: the second turn's prompt holds the first turn, whose prompt the prefix
    cache serves; an unknown id and a store=false response are not found (400, OpenAI's shape)."""
    first = client.responses.create(model="tiny", input="Remember: blue.", instructions="Be brief.",
                                    max_output_tokens=4, extra_body=GREEDY)
    second = client.responses.create(model="tiny", input="What did I say?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=4, extra_body=GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    for missing in ("resp_nope", unstored.id):
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="tiny", input="x", previous_response_id=missing, max_output_tokens=2)
        assert exc.value.body["code"] == "previous_response_not_found"
        assert exc.value.body["param"] == "previous_response_id"


def test_reasoning_item(client):
    """reasoning.effort turns the template's thinking on: the reply is a reasoning item (streamed as
    reasoning_text events); effort "none" turns it off."""
    args = {"model": "tiny", "input": "Hello there", "reasoning": {"effort": "medium"}, "max_output_tokens": 8}
    stop = _stop_after(client, 4, input="Hello there", reasoning={"effort": "medium"})
    r = client.responses.create(**args, extra_body=GREEDY)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text and r.output_text == ""
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 8
    with client.responses.stream(**args, extra_body={**GREEDY, "stop": [stop]}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text
    off = client.responses.create(**{**args, "reasoning": {"effort": "none"}}, extra_body=GREEDY)
    assert [o.type for o in off.output] == ["message"]


def test_errors_are_openai_shaped(server):
    for body in ({"model": "tiny"},  # no input
                 {"model": "tiny", "input": [{"type": "input_image", "image_url": "x"}]},
                 {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                 {"model": "tiny", "input": "x", "tool_choice": "required"},
                 {"model": "tiny", "input": "x", "max_output_tokens": 0},
                 {"model": "tiny", "input": "x", "store": "no"},
                 {"model": "tiny", "input": [], "instructions": "only instructions"},
                 {"model": "tiny", "input": "x", "max_output_tokens": CONTEXT}):
        status, kind, raw = post(server.url + "/v1/responses", body)
        err = json.loads(raw)["error"]
        assert status == 400 and kind.startswith("application/json") and err["type"] == "invalid_request_error"
        assert err["message"] and set(err) == {"message", "type", "param", "code"}
        assert "max_tokens" not in err["message"] and err["param"] != "max_tokens"


# ---- the frames, without the engine ----------------------------------------------------------------
def _sdk_replay(frames: list[tuple[str, dict]]) -> Response:
    """Feed the frames to the SDK's stream state machine (which checks order and identities)."""
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for name, data in frames:
        assert name == data["type"]
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    return state._completed_response


def test_reasoning_text_and_namespaced_calls():
    """Reasoning, text and two calls (one to a function of a namespace tool) in model text become
    output items, each opened, filled and closed in order; the stored conversation takes them back."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "spawn_agent", "parameters": {"type": "object"}}}]
    store = R.ResponseStore(capacity=2)
    req = R.ResponsesRequest("responses", "tiny", [[1]], SamplingParams(), True, False, "max_output_tokens", True,
                             output=OutputPlan("qwen3", False, "qwen3_coder", tools), request_id="resp_x",
                             history=[{"role": "user", "content": "go"}],
                             namespaces={"spawn_agent": "multi_agent_v1"}, store=store)
    text = ("<think>hm</think>Ok.<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=spawn_agent>\n</function>\n</tool_call>")
    s = R.ResponseStream(req, lambda t: len(t.split()))
    frames = s.start()
    for i in range(0, len(text), 4):
        frames += s.event(StreamEvent(text[i:i + 4], [0]))
    frames += s.end(StreamEvent("", [], "stop", 5, 30, 2))
    final = _sdk_replay(frames)
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, f, spawn = final.output
    assert reasoning.content[0].text == "hm" and message.content[0].text == "Ok."
    assert (f.name, json.loads(f.arguments), f.namespace) == ("f", {"a": 1}, None)
    assert (spawn.name, spawn.namespace) == ("spawn_agent", "multi_agent_v1")
    assert final.usage.input_tokens_details.cached_tokens == 2 and final.usage.output_tokens_details.reasoning_tokens == 1
    stored = store.get("resp_x")
    assert stored.messages[0] == {"role": "user", "content": "go"}
    assert stored.messages[1]["reasoning_content"] == "hm" and stored.messages[1]["content"] == "Ok."
    assert [c["function"]["name"] for c in stored.messages[1]["tool_calls"]] == ["f", "spawn_agent"]


def test_failed_and_incomplete_frames():
    """An error after the start is response.failed; a reply cut by max_output_tokens marks its last
    item and the response incomplete. Both pass the SDK's stream parser."""
    req = R.ResponsesRequest("responses", "tiny", [[1]], SamplingParams(), True, False, "max_output_tokens", True,
                             request_id="resp_y")
    s = R.ResponseStream(req, len)
    frames = s.start() + s.event(StreamEvent("Hel", [0])) + s.error("the request was aborted", 503)
    assert frames[-1][1]["response"]["status"] == "failed" and frames[-1][1]["response"]["error"]["code"] == "aborted"
    _sdk_replay(frames)
    s = R.ResponseStream(req, len)
    frames = s.start() + s.event(StreamEvent("Hel", [0])) + s.end(StreamEvent("", [], "length", 3, 1, 0))
    assert _sdk_replay(frames) is None  # not completed: the SDK's get_final_response raises
    done = frames[-1][1]["response"]
    assert frames[-1][0] == "response.incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["status"] == "incomplete" and done["output"][0]["content"][0]["text"] == "Hel"


def test_store_is_bounded():
    store = R.ResponseStore(capacity=2)
    for rid in ("a", "b", "c"):
        store.put(rid, R.Stored({}, []))
    assert len(store) == 2 and store.get("a") is None
    store.get("b")  # used: "c" goes next
    store.put("d", R.Stored({}, []))
    assert store.get("b") is not None and store.get("c") is None


def test_input_items_to_messages():
    items = [{"role": "developer", "content": "sys"}, {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    assert R.input_messages(items) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}, {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done"}]


# ---- Codex CLI's requests --------------------------------------------------------------------------
def _events(raw: bytes, status: int) -> list[dict]:
    assert status == 200, raw[:500]
    lines = [line for line in raw.decode().split("\n") if line]
    events = [(lines[i][len("event: "):], json.loads(lines[i + 1][len("data: "):])) for i in range(0, len(lines), 2)]
    assert all(name == data["type"] for name, data in events)
    return [data for _, data in events]


def test_corpus_is_codex():
    assert [p.name for p in BODIES] == ["1_turn1.json", "2_turn1_tool_output.json", "3_turn2.json",
                                        "4_ktlite_frames_tool_output.json"]
    for path in BODIES:
        body = _load(path)
        assert body["store"] is False and body["stream"] is True and "instructions" not in body
        assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    kinds = [item.get("type") for item in _load(CORPUS / "2_turn1_tool_output.json")["input"]]
    assert kinds[-2:] == ["function_call", "function_call_output"]
    kinds = [item.get("type") for item in _load(CORPUS / "4_ktlite_frames_tool_output.json")["input"]]
    assert kinds[-4:] == ["reasoning", "message", "function_call", "function_call_output"]


def test_codex_echoes_our_items():
    """What Codex sent back after ktlite's own frames (reasoning, text, a call) is one assistant turn."""
    body = _load(CORPUS / "4_ktlite_frames_tool_output.json")
    assistant, tool = R.input_messages(body["input"])[-2:]
    assert assistant["reasoning_content"] == "The user wants a.txt." and assistant["content"] == "Let me look."
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["exec_command"]
    assert tool["role"] == "tool" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"]


@pytest.mark.parametrize("path", BODIES, ids=lambda p: p.stem)
def test_every_body_accepted_verbatim(path, engine, caplog):
    """Parsed as sent: the function tools and the namespace's functions reach the template, the hosted
    web_search tool is dropped (logged), the history renders in order, nothing is stored."""
    body = _load(path)
    R._log_dropped.cache_clear()
    with caplog.at_level(logging.INFO, logger=R.__name__):
        req = R.parse_request(body, engine.tokenizer, CONTEXT, "tiny", store=R.ResponseStore(), **PARSERS)
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        "responses: dropped the 'web_search' tools of a request: only function tools can be offered to the model"]
    text = engine.tokenizer.decode(req.prompts[0])
    names = [t["name"] for t in body["tools"] if t["type"] == "function"]
    names += [t["name"] for ns in body["tools"] if ns["type"] == "namespace" for t in ns["tools"]]
    assert all(json.dumps(n) in text for n in names) and set(req.namespaces.values()) == {"multi_agent_v1"}
    assert req.store is None and req.stream and req.params.max_tokens == CONTEXT - len(req.prompts[0])
    assert text.index("<|im_start|>system\nYou are a coding agent") < text.index("what is in a.txt?")
    if path.name != "1_turn1.json":
        assert "<function=exec_command><parameter=cmd>\ncat a.txt" in text and "<tool_response>" in text


def test_codex_turns_replayed(server, engine):
    """The requests (shrunk), streamed as Codex asks: each answers with well-formed events, and each
    turn of a session reads from the cache the prompt prefix the previous one left."""
    previous, session, stored = None, None, len(server.server.responses)
    for path in BODIES:
        body = _shrunk(_load(path))
        status, _, raw = post(server.url + "/v1/responses", body)
        events = _events(raw, status)
        assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["store"] is False
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        usage = events[-1]["response"]["usage"]
        if body["prompt_cache_key"] == session:
            assert usage["input_tokens_details"]["cached_tokens"] >= previous["input_tokens"] - 1
            assert usage["input_tokens"] > previous["input_tokens"]
        previous, session = usage, body["prompt_cache_key"]
    assert len(server.server.responses) == stored  # store: false
