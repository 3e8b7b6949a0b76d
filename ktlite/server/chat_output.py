"""A chat reply's text -> reasoning, content and tool calls; the same pipeline streamed and whole.

    plan = OutputPlan(reasoning_parser="qwen3", tool_parser="qwen3_coder", tools=tools)
    out = parse_output(plan, text)              # ChatOutput(reasoning, content, tool_calls)
    s = OutputStream(plan); s.feed(delta) / s.finish()  -> Piece(reasoning, content, tool_calls deltas)

Order: reasoning is split off first (`ktlite/server/reasoning.py`), then the content goes through
the tool-call parser (`ktlite/server/tool_parsers/`), so call markup never reaches `content`. The
tool parser's region markers also end an unclosed think block (SGLang's rule), so a call the model
starts while still reasoning is parsed as a call rather than swallowed into the reasoning.
`parse_output` is one `feed` plus `finish`, so streamed and whole replies agree by construction.

Forced calls (`tool_choice` "required" or a named function): the output was constrained by the
grammar to one JSON object `{"name": ..., "arguments": {...}}` (see `forced_call_schema`), which is
returned as the call. That shape, rather than the model's own call markup, is enforced because it
works for every model and template, with or without `--tool-call-parser`: the markup formats mix
special tokens and typed text values that a JSON-schema grammar cannot express, while the JSON
object is exactly the call. It is streamed once complete (a call is only valid when whole); an
output cut short (max_tokens) is returned as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ktlite.server.reasoning import reasoning_stream, think_format
from ktlite.server.tool_parsers import ToolCallStream, dump_arguments


@dataclass(frozen=True)
class OutputPlan:
    """How one request's output is taken apart (all off: the text is the content)."""

    reasoning_parser: str | None = None
    prompt_opens_think: bool = False  # the rendered prompt already opened the think block
    tool_parser: str | None = None  # parse the model's call markup (tools offered, tool_choice auto)
    tools: list[dict[str, Any]] | None = None
    forced_call: bool = False  # the output is a grammar-constrained {"name", "arguments"} object
    id_prefix: str = "call_"  # OpenAI's call ids; Anthropic's are "toolu_"

    @property
    def reads_special_tokens(self) -> bool:
        """The parsers read markup that tokenizers mark special (harmony's channels, tool-call tokens such as
        Kimi's): the text keeps special tokens, as SGLang does for gpt-oss and for requests with tools."""
        return self.tool_parser is not None or (self.reasoning_parser is not None
                                                and think_format(self.reasoning_parser).harmony)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChatOutput:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


@dataclass
class Piece:
    """What one streamed delta adds: text, and OpenAI tool_call deltas (a call's first carries its id
    and name with arguments "", later ones argument fragments)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def forced_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call to `name` (or to any of `tools`): {"name": const, "arguments": params}."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


class OutputStream:
    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self._tools = ToolCallStream(plan.tool_parser, plan.tools) \
            if plan.tool_parser and plan.tools and not plan.forced_call else None
        self._reasoning = reasoning_stream(plan.reasoning_parser, plan.prompt_opens_think,
                                           self._tools.region_starts if self._tools else ()) \
            if plan.reasoning_parser else None
        self._forced: list[str] = []  # forced calls: the JSON text, parsed at the end
        self.calls: list[ToolCall] = []
        self._ids: dict[int, str] = {}  # parser's call index -> our id

    def feed(self, delta: str) -> Piece:
        return self._step(delta, final=False)

    def finish(self) -> Piece:
        return self._step("", final=True)

    def _step(self, delta: str, final: bool) -> Piece:
        piece = Piece()
        if self.plan.forced_call:
            self._forced.append(delta)
            if final:
                self._finish_forced(piece)
            return piece
        text = delta
        if self._reasoning is not None:
            piece.reasoning, text = self._reasoning.finish() if final else self._reasoning.feed(delta)
        if self._tools is None:
            piece.content = text
            return piece
        content, deltas = self._tools.feed(text) if text else ("", [])
        if final:
            tail, more = self._tools.finish()
            content, deltas = content + tail, deltas + more
        piece.content = content
        piece.tool_calls = [self._own_id(d) for d in deltas]
        return piece

    def _own_id(self, delta: dict[str, Any]) -> dict[str, Any]:
        """Re-id a call's first delta with our prefix; record the call when its arguments arrive."""
        index = delta["index"]
        if "id" in delta:
            self._ids[index] = new_id(self.plan.id_prefix)
            self.calls.append(ToolCall(self._ids[index], delta["function"]["name"], ""))
            return {**delta, "id": self._ids[index]}
        self.calls[index].arguments += delta["function"]["arguments"]
        return delta

    def _finish_forced(self, piece: Piece) -> None:
        text = "".join(self._forced)
        try:
            obj = json.loads(text)
        except ValueError:  # cut short before the grammar completed it
            piece.content = text
            return
        call = ToolCall(new_id(self.plan.id_prefix), obj["name"], dump_arguments(obj["arguments"]))
        self.calls.append(call)
        piece.tool_calls = [{"index": 0, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}},
                            {"index": 0, "function": {"arguments": call.arguments}}]


def parse_output(plan: OutputPlan, text: str) -> ChatOutput:
    """The whole reply at once: exactly what the streamed pieces add up to."""
    stream = OutputStream(plan)
    a, b = stream.feed(text), stream.finish()
    return ChatOutput(a.reasoning + b.reasoning, a.content + b.content, stream.calls)
