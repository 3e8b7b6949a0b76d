"""Tools, tool_choice and reasoning in the chat API.

The model is the tiny random one with a chat template that renders tools, tool calls, tool results
and a thinking switch (tests/chat_templates.py); the server runs with --tool-call-parser qwen3_coder
and --reasoning-parser qwen3. A random model emits no call markup, so the parsers' wiring is checked
by feeding known text through the server's own response builders (non-streamed and streamed); the
rendering is checked against transformers' apply_chat_template, and end to end by the prompt length.
"""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import transformers
from chat_templates import MAPPING, TEXT, with_template

from ktlite import Engine
from ktlite.runtime.scheduler import StreamEvent
from ktlite.runtime.tiny_model import BOS
from ktlite.runtime.tokenizer import Tokenizer
from ktlite.server import ServerOptions, ServerThread
from ktlite.server.protocol import Collected, OpenAIStream, chat_response, parse_chat
from ktlite.server.reasoning import split_reasoning

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 1024,
                "max_running_requests": 8, "gpu_memory": "1GiB", "served_model_name": "tiny"}
TOOLS = [
    {"type": "function", "function": {
        "name": "set_light", "description": "Switch a light.",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                        "room": {"enum": ["kitchen", "hall"]}},
                       "required": ["on", "room"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_heat", "description": "Set the heating level.",
        "parameters": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 5},
                                                        "zones": {"type": "array", "items": {"enum": ["a", "b"]},
                                                                  "maxItems": 2}},
                       "required": ["level"], "additionalProperties": False}}},
]
HISTORY = [
    {"role": "system", "content": "You run the house."},
    {"role": "user", "content": "Lights on in the hall."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "set_light", "arguments": json.dumps({"on": True, "room": "hall"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    {"role": "user", "content": "Now warm it up."},
]
PARSERS = {"tool_call_parser": "qwen3_coder", "reasoning_parser": "qwen3"}


@pytest.fixture(scope="module")
def model(tiny_v3, tmp_path_factory):
    return with_template(tiny_v3, tmp_path_factory.mktemp("tools") / "mapping", MAPPING, context=2048)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(str(model), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with ServerThread(engine, ServerOptions(port=0, **PARSERS)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_prompt(model, template: str, messages, tools, dict_arguments: bool, **kwargs) -> str:
    """transformers' rendering; templates that iterate arguments get them as dicts there (HF's convention)."""
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"),
                                               bos_token=BOS)
    messages = copy.deepcopy(messages)
    if dict_arguments:
        for m in messages:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return ref.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("template,dict_arguments,call", [
    (MAPPING, True, "<function=set_light><parameter=on>\nTrue\n</parameter><parameter=room>\nhall"),
    (TEXT, False, '```json\n{"on": true, "room": "hall"}\n```')], ids=["mapping", "text"])
def test_tools_and_history_render_like_transformers(model, tmp_path, template, dict_arguments, call):
    """OpenAI-shaped history (arguments as JSON text) renders as transformers renders it, whether the
    template iterates the arguments or concatenates them."""
    ours = Tokenizer(with_template(model, tmp_path / "m", template))
    for tools in (TOOLS, None):
        expected = reference_prompt(model, template, HISTORY, tools, dict_arguments, enable_thinking=True)
        assert ours.render_chat(HISTORY, tools=tools, enable_thinking=True) == expected
    assert call in ours.render_chat(HISTORY)


def test_tools_reach_the_template(client, model, engine):
    def prompt_tokens(**kw) -> int:
        r = client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=1, **kw)
        return r.usage.prompt_tokens

    expected = reference_prompt(model, MAPPING, HISTORY, TOOLS, True, enable_thinking=False)
    assert prompt_tokens(tools=TOOLS) == len(engine.tokenizer.encode(expected, add_bos=False))
    plain = reference_prompt(model, MAPPING, HISTORY, None, True)
    assert prompt_tokens() == prompt_tokens(tools=TOOLS, tool_choice="none") == \
        len(engine.tokenizer.encode(plain, add_bos=False)) < prompt_tokens(tools=TOOLS)
    with_thinking = reference_prompt(model, MAPPING, HISTORY, None, True, enable_thinking=True)
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == \
        len(engine.tokenizer.encode(with_thinking, add_bos=False))


def _validate_call(call, name: str | None = None) -> None:
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in tools and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_heat"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_always_gives_a_valid_call(client, choice):
    def one(seed: int):
        return client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice=choice,
                                              seed=seed, temperature=1.0, max_tokens=120)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(12)))
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    for r in replies:
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1
        _validate_call(message.tool_calls[0], name)
    if name is None:
        assert {r.choices[0].message.tool_calls[0].function.name for r in replies} == {"set_light", "set_heat"}


def test_forced_tool_choice_streaming(client):
    for seed in range(3):
        chunks = list(client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, seed=seed,
                                                     tool_choice="required", max_tokens=120, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert deltas[0].id and deltas[0].function.name and {d.index for d in deltas} == {0}
        arguments = "".join(d.function.arguments or "" for d in deltas)
        call = openai.types.chat.ChatCompletionMessageToolCall(
            id=deltas[0].id, type="function", function={"name": deltas[0].function.name, "arguments": arguments})
        _validate_call(call)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400(client):
    cases = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
               "tool_choice": "required"}, "tools")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=HISTORY, max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == param, err.value.body


# ---- the parsers' wiring, with text a model would write -------------------------------------------
MODEL_TEXT = ("<think>\nThe hall is cold.\n</think>\n\nWarming it.\n<tool_call>\n<function=set_heat>\n"
              "<parameter=level>\n3\n</parameter>\n<parameter=zones>\n[\"a\"]\n</parameter>\n</function>\n"
              "</tool_call>")


def test_parsed_reply_non_streamed_and_streamed(engine):
    body = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 64}
    parsed = parse_chat(body, engine.tokenizer, engine.runtime.context_length, "tiny", **PARSERS)
    whole = chat_response(parsed, [Collected(MODEL_TEXT, [], "stop", 10, 20, 0)])
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "The hall is cold." and message["content"] == "Warming it."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "set_heat"
    assert json.loads(call["function"]["arguments"]) == {"level": 3, "zones": ["a"]}

    stream = OpenAIStream(parsed)
    frames = stream.start()
    for i in range(0, len(MODEL_TEXT), 5):  # 5-character deltas cut through every marker
        frames += stream.event(StreamEvent(MODEL_TEXT[i:i + 5], [0]))
    frames += stream.end(StreamEvent("", [], "stop", 10, 20))
    deltas = [f[1]["choices"][0]["delta"] for f in frames]
    assert "".join(d.get("content") or "" for d in deltas) == "Warming it."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The hall is cold."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "set_heat", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert frames[-1][1]["choices"][0]["finish_reason"] == "tool_calls"

    no_split = parse_chat({**body, "separate_reasoning": False}, engine.tokenizer, engine.runtime.context_length,
                          "tiny", **PARSERS)
    kept = chat_response(no_split, [Collected(MODEL_TEXT, [], "stop", 10, 20, 0)])["choices"][0]["message"]
    assert kept["content"].startswith("<think>\nThe hall is cold.") and "reasoning_content" not in kept


def test_reasoning_when_the_prompt_opens_think(client):
    """enable_thinking makes the template open <think> in the prompt: the reply is reasoning until
    </think>, streamed or not; separate_reasoning false keeps it all in content."""
    msgs = [{"role": "user", "content": "Think first."}]
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    greedy = {"model": "tiny", "messages": msgs, "temperature": 0.0, "max_tokens": 16}
    raw = client.chat.completions.create(**greedy, extra_body={**think, "separate_reasoning": False})
    text = raw.choices[0].message.content
    reasoning, content = split_reasoning("qwen3", text, prompt_opens_think=True)
    assert reasoning
    split = client.chat.completions.create(**greedy, extra_body=think).choices[0].message
    assert split.reasoning_content == reasoning and (split.content or "") == content
    chunks = list(client.chat.completions.create(**greedy, extra_body=think, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    plain = client.chat.completions.create(**greedy).choices[0].message
    assert plain.reasoning_content is None and plain.content
