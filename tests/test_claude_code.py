"""Claude Code's requests, replayed through the Anthropic route (issue items 1 and 5).

tests/data/agents/claude_code/ holds request bodies recorded from the real Claude Code CLI (2.1.197,
see the README there): a session title request, turn 1, turn 1 after its Read tool ran, and turn 2
(`claude -p --continue`). They carry everything current Claude Code sends: the per-request billing
header as the first system block, `cache_control` on blocks, `thinking: {"type": "adaptive"}`,
`output_config` (effort; a json_schema format on the title request), `context_management`,
`metadata`, a mid-conversation `role: "system"` message, thinking blocks with signatures,
tool_use / tool_result and 25 tools.

Every body is accepted verbatim (parsed with its max_tokens of 32000, and counted over HTTP); the
billing line never reaches the rendered prompt. Its ~45k-token prompt (in the tiny model's
1024-token vocabulary) takes minutes to prefill on a CPU, so the end-to-end replay uses the same
bodies with their long texts cut (`_shrunk`: the same structure and fields, the same prefix
relations between turns) and max_tokens 8: each turn reuses the previous turn's prompt from the
prefix cache. The thinking budget (`thinking.budget_tokens`) is checked end to end on the tiny model.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
from chat_templates import MAPPING, with_template

from ktlite import Engine
from ktlite.runtime.sampling import SamplerState, SamplingParams
from ktlite.server import ServerOptions, ServerThread
from ktlite.runtime.tokenizer import Tokenizer
from ktlite.server import anthropic as A
from ktlite.server.protocol import chat_prompt
from test_anthropic_api import post

CORPUS = Path(__file__).parent / "data" / "agents" / "claude_code"
BODIES = sorted(CORPUS.glob("*.json"))
CONTEXT = 131072  # the verbatim bodies ask for max_tokens 32000 on top of their ~45k-token prompts
ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 16384, "chunked_prefill_size": 2048,
                "max_running_requests": 4, "gpu_memory": "1GiB", "served_model_name": "tiny"}
PARSERS = {"tool_parser": "qwen3_coder", "reasoning_parser": "qwen3"}
CUT = 200  # characters kept of each long text in the end-to-end replay


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _shrunk(body: dict) -> dict:
    """The body with its long texts cut to CUT characters and only the tools the session used (Read,
    Bash): deterministic, so consecutive turns keep their common prefix."""
    body = copy.deepcopy(body)
    body["max_tokens"] = 8
    body["temperature"] = 0.0
    for block in body["system"]:
        block["text"] = block["text"][:CUT]
    body["tools"] = [{**t, "description": t["description"][:CUT]} for t in body.get("tools", [])
                     if t["name"] in ("Read", "Bash")]
    for m in body["messages"]:
        if isinstance(m["content"], str):
            m["content"] = m["content"][:CUT]
        else:
            for block in m["content"]:
                if isinstance(block.get("text"), str):
                    block["text"] = block["text"][:CUT]
    return body


@pytest.fixture(scope="module")
def model(tiny_v3, tmp_path_factory) -> Path:
    return with_template(tiny_v3, tmp_path_factory.mktemp("claude_code") / "m", MAPPING, context=CONTEXT)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(str(model), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerOptions(port=0, tool_call_parser=PARSERS["tool_parser"],
                                            reasoning_parser=PARSERS["reasoning_parser"])) as s:
        yield s


def _rendered(body: dict, tokenizer) -> str:
    spec = A.chat_spec(body)
    return tokenizer.render_chat(spec.messages, tools=spec.tools, **spec.template_kwargs)


def test_corpus_is_claude_code():
    assert [p.name for p in BODIES] == ["1_title.json", "2_turn1.json", "3_turn1_tool_result.json", "4_turn2.json"]
    for path in BODIES:
        body = _load(path)
        assert body["system"][0]["text"].startswith(A.BILLING_HEADER)
        assert {"metadata", "output_config", "max_tokens", "stream"} <= set(body)
    turn = _load(CORPUS / "2_turn1.json")
    assert turn["thinking"] == {"type": "adaptive"} and "context_management" in turn and len(turn["tools"]) > 20
    assert any(m["role"] == "system" for m in turn["messages"])


@pytest.mark.parametrize("path", BODIES, ids=lambda p: p.stem)
def test_every_body_accepted_verbatim(path, engine, server):
    """Parsed as sent (max_tokens 32000 included), no billing line in the prompt, counted over HTTP."""
    body = _load(path)
    tokenizer = engine.tokenizer
    text = _rendered(body, tokenizer)
    assert "x-anthropic-billing-header" not in text and "cc_version=" not in text
    assert body["system"][1]["text"] in text  # the rest of the system prompt stays
    for tool in body.get("tools", []):
        assert json.dumps(tool["name"]) in text  # tools go through the model's own template
    req = A.parse_request(body, tokenizer, CONTEXT, "tiny", **PARSERS)
    assert req.params.max_tokens == body["max_tokens"]
    assert (req.params.json_schema is not None) == ("format" in body["output_config"])
    assert req.params.thinking_budget is None  # adaptive: thinking without a budget
    status, _, reply = post(server.url + "/v1/messages/count_tokens?beta=true", body)
    assert status == 200, reply
    assert json.loads(reply)["input_tokens"] == len(req.prompts[0])


def test_billing_header_dropped_once_logged(engine, caplog):
    A._log_billing_dropped.cache_clear()
    with caplog.at_level(logging.INFO, logger=A.__name__):
        for path in BODIES:
            A.chat_spec(_load(path))
    assert len([r for r in caplog.records if "billing header" in r.getMessage()]) == 1
    # only that block goes: a system prompt that merely mentions it stays
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "system": [{"type": "text", "text": "about x-anthropic-billing-header: lines"}]}
    assert "about x-anthropic-billing-header" in _rendered(body, engine.tokenizer)


# the guard Qwen3.5's and MiniMax's templates carry: a system message only at the start
GUARDED = ("{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
           "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}" + MAPPING)


def test_late_system_message_with_a_guarded_template(tiny_v3, tmp_path):
    """A template that takes a system message only at the start gets Claude Code's mid-conversation
    system message as a user turn in its place; consecutive turns still share their prefix."""
    tokenizer = Tokenizer(with_template(tiny_v3, tmp_path / "guarded", GUARDED))
    prompts = []
    for name in ("3_turn1_tool_result.json", "4_turn2.json"):
        body = _load(CORPUS / name)
        late = next(m["content"] for m in body["messages"] if m["role"] == "system")
        prompts.append(chat_prompt(A.chat_spec(body), tokenizer).ids)
        assert "<|im_start|>user\n" + late[:100] in tokenizer.decode(prompts[-1])
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert common > 0.9 * len(prompts[0])
    lone = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}],
            "system": "only at the start"}
    assert chat_prompt(A.chat_spec(lone), tokenizer).ids  # a leading system message renders as before


def _stream(server, body: dict) -> list[tuple[str, dict]]:
    status, kind, raw = post(server.url + "/v1/messages?beta=true", body)
    assert status == 200 and kind.startswith("text/event-stream"), raw[:500]
    lines = [line for line in raw.decode().split("\n") if line]
    return [(lines[i][len("event: "):], json.loads(lines[i + 1][len("data: "):])) for i in range(0, len(lines), 2)]


def test_turns_share_the_cache(server, engine):
    """Replayed in order (streamed, as Claude Code asks): every request answers, and each turn reads
    from the cache the prompt prefix the previous one left, billing header notwithstanding."""
    tokenizer = engine.tokenizer
    previous: list[int] | None = None
    for path in BODIES:
        body = _shrunk(_load(path))
        ids = A.parse_request(body, tokenizer, CONTEXT, "tiny", **PARSERS).prompts[0]
        events = _stream(server, body)
        names = [name for name, _ in events]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        usage = events[0][1]["message"]["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids)
        if previous is not None and path.name != "2_turn1.json":  # the title request is another conversation
            common = next((i for i, (a, b) in enumerate(zip(previous, ids)) if a != b), min(len(previous), len(ids)))
            assert common > 0.9 * len(previous)
            assert usage["cache_read_input_tokens"] >= common - 1  # the cache matches whole tokens
        previous = ids


def test_thinking_budget_end_to_end(server, engine):
    """budget_tokens N: the think block holds the first N tokens the model would think, then the
    close tag is forced and the answer follows; without a budget it thinks on."""
    user = [{"role": "user", "content": "Hello there, tiny model"}]
    free = {"model": "tiny", "max_tokens": 24, "temperature": 0.0, "messages": user, "thinking": {"type": "adaptive"}}
    ids = A.parse_request(free, engine.tokenizer, CONTEXT, "tiny", **PARSERS).prompts[0]
    raw = engine.generate(input_ids=ids, sampling_params={"max_tokens": 24, "temperature": 0.0})
    assert "</think>" not in raw.text[:40]  # the free run thinks past the budget
    status, _, reply = post(server.url + "/v1/messages", free)
    assert status == 200
    free_reply = json.loads(reply)
    assert [b["type"] for b in free_reply["content"]] == ["thinking"]
    budget = 5
    capped = {**free, "thinking": {"type": "enabled", "budget_tokens": budget}}
    status, _, reply = post(server.url + "/v1/messages", capped)
    assert status == 200, reply
    m = json.loads(reply)
    assert [b["type"] for b in m["content"]] == ["thinking", "text"], m
    assert m["content"][0]["thinking"] == engine.tokenizer.decode(raw.token_ids[:budget]).strip()
    assert m["content"][1]["text"]
    events = _stream(server, {**capped, "stream": True})
    blocks = [d["content_block"]["type"] for name, d in events if name == "content_block_start"]
    assert blocks == ["thinking", "text"]
    status, _, reply = post(server.url + "/v1/messages", {**free, "thinking": {"type": "enabled", "budget_tokens": 0}})
    assert status == 400 and "budget_tokens" in json.loads(reply)["error"]["message"]


def test_forced_close_tag_only_while_the_block_is_open():
    params = SamplingParams(max_tokens=20, thinking_budget=3, think_end_ids=[7, 8])
    state = SamplerState([1, 2])
    forced = []
    for token in (5, 6, 9):
        assert state.forced_token(params) is None
        state.append(token)
    for _ in range(3):
        forced.append(state.forced_token(params))
        if forced[-1] is not None:
            state.append(forced[-1])
    assert forced == [7, 8, None]
    closed = SamplerState([1, 2])
    for token in (7, 8, 9):
        closed.append(token)
    assert closed.forced_token(params) is None and closed.forced_token(params) is None
