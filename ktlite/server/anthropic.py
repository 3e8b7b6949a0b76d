"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the same engine.

A request is translated into the chat terms the OpenAI side uses (`ChatSpec`: OpenAI-shaped
messages and tools), so the template, the grammar for forced tool calls and the reasoning and
tool-call parsers are shared; only the JSON in and out differs:
- `system` (text or text blocks) -> a system message; user `tool_result` blocks -> `role: "tool"`
  messages; assistant `tool_use` blocks -> `tool_calls` (arguments as JSON text), `thinking` blocks
  -> `reasoning_content`; `role: "system"` turns inside `messages` (Claude Code's mid-conversation
  system messages) -> system messages where they stand (user turns in their place if the template
  refuses a system message after the start: `protocol.chat_prompt`); images and documents are
  refused (400).
- Claude Code's billing header (a system text block `x-anthropic-billing-header: cc_version=...;`
  whose hash changes between requests) is dropped before templating, so consecutive turns share
  their prompt prefix in the cache; the first drop is logged.
- `tools` [{name, description, input_schema}] -> OpenAI function tools, rendered by the model's
  own chat template; `tool_choice` auto / any / tool / none -> auto / required / named / none;
  `thinking` enabled / adaptive / disabled -> the template variables `thinking` and
  `enable_thinking`; `budget_tokens` (enabled) is enforced when a reasoning parser is set: after
  that many output tokens inside the think block the close tag is forced and the answer follows
  (SGLang's thinking budget). `output_config.format` json_schema constrains the output as
  OpenAI's response_format does; `output_config.effort`, `context_management`, `metadata`,
  `cache_control` on any block, and other fields this server has no use for are ignored.
- Replies: content blocks thinking (with an empty `signature`: nothing is signed here), text,
  tool_use; `stop_reason` end_turn / max_tokens / stop_sequence / tool_use.
- Usage: `input_tokens` counts the prompt tokens that were prefilled, `cache_read_input_tokens` those
  the prefix cache served (Anthropic's split: their sum is the prompt).
- Errors: {"type": "error", "error": {"type", "message"}} with the status's Anthropic type.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from ktlite.runtime.sampling import is_int
from ktlite.runtime.scheduler import StreamEvent
from ktlite.server.chat_output import ChatOutput, OutputStream, Piece
from ktlite.server.protocol import (APIError, ChatSpec, Frame, ParsedRequest, bad_request, chat_prompt, parse_tools,
                                    sampling_params)
from ktlite.server.reasoning import think_format

logger = logging.getLogger(__name__)

BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-request first system block

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


# ---- requests ------------------------------------------------------------------------------------
def _text_of(content: Any, param: str) -> str:
    """A string, or text blocks joined (tool_result contents, system prompts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise bad_request(f"{param}: only text blocks are supported here, got {kind!r}", param)
            parts.append(block["text"])
        return "".join(parts)
    raise bad_request(f"{param} must be a string or a list of text blocks", param)


@functools.cache
def _log_billing_dropped() -> None:
    """Logs once per process (the cache makes later calls no-ops)."""
    logger.info("dropped Claude Code's billing header from the system prompt (%r...): it changes on every "
                "request and would end the prompt prefix the cache can reuse", BILLING_HEADER)


def _system(value: Any) -> str:
    """`system` -> one text, without Claude Code's billing header block."""
    if isinstance(value, list):
        kept = [b for b in value if not (isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) and b["text"].startswith(BILLING_HEADER))]
        if len(kept) < len(value):
            _log_billing_dropped()
        value = kept
    return _text_of(value, "system")


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{param} must be a string or a list of content blocks", param)
    return content


def _user_messages(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    out, text = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{param}[{j}].tool_use_id must be a string", f"{param}[{j}].tool_use_id")
            result = _text_of(block.get("content", ""), f"{param}[{j}].content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise bad_request(f"{param}[{j}]: content block type {kind!r} is not supported in user turns "
                              "(text and tool_result are)", f"{param}[{j}]")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_message(blocks: list[dict[str, Any]], param: str) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque to anyone but its issuer
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise bad_request(f"{param}[{j}]: tool_use needs a string id and name and an object input",
                                  f"{param}[{j}]")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        else:
            raise bad_request(f"{param}[{j}]: content block type {kind!r} is not supported in assistant turns "
                              "(text, thinking and tool_use are)", f"{param}[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: a non-empty list of {role, content} is required", "messages")
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _system(body["system"])
        if system or not isinstance(body["system"], list):
            out.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"{param}.role must be 'user', 'assistant' or 'system'", f"{param}.role")
        if m["role"] == "system":  # a mid-conversation system message (Claude Code sends them)
            out.append({"role": "system", "content": _text_of(m.get("content"), f"{param}.content")})
            continue
        blocks = _blocks(m.get("content"), f"{param}.content")
        if m["role"] == "user":
            out.extend(_user_messages(blocks, f"{param}.content"))
        else:
            out.append(_assistant_message(blocks, f"{param}.content"))
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be a list of {name, description, input_schema}", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only client tools with an input_schema are supported (got type {kind!r})",
                              f"tools[{i}]")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        tools.append({"type": "function", "function": fn})
    return parse_tools(tools)


def _tool_choice(value: Any) -> tuple[str, str | None]:
    kind = value.get("type") if isinstance(value, dict) else None if value is None else "invalid"
    if kind is None or kind == "auto":
        return "auto", None
    if kind == "any":
        return "required", None
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(value.get("name"), str):
        return "required", value["name"]
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
                      "tool_choice")


def _thinking(value: Any) -> dict[str, Any]:
    """`thinking` -> template variables (both names that templates use for the switch); "adaptive"
    is "enabled" without a budget."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request('thinking.type must be "enabled", "adaptive" or "disabled"', "thinking.type")
    on = kind != "disabled"
    return {"thinking": on, "enable_thinking": on}


def thinking_budget(value: Any) -> int | None:
    """`thinking.budget_tokens` of an enabled `thinking`, else None (no budget)."""
    if not isinstance(value, dict) or value.get("type") != "enabled" or value.get("budget_tokens") is None:
        return None
    budget = value["budget_tokens"]
    if not is_int(budget) or budget < 1:
        raise bad_request(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}", "thinking.budget_tokens")
    return budget


def _output_schema(value: Any) -> dict[str, Any] | None:
    """`output_config.format` {"type": "json_schema", "schema"} -> the schema; `effort` is ignored."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("output_config must be an object", "output_config")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}',
                          "output_config.format")
    return fmt["schema"]


def chat_spec(body: dict[str, Any]) -> ChatSpec:
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"))
    if choice == "required" and not tools:
        raise bad_request("tool_choice requires a tool call but no tools were given", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the tool {name!r}, which is not in tools", "tool_choice")
    return ChatSpec(_messages(body), tools, choice, name, response_schema=_output_schema(body.get("output_config")),
                    template_kwargs=_thinking(body.get("thinking")))


def parse_request(body: dict[str, Any], tokenizer, context_length: int, model: str, tool_parser: str | None,
                  reasoning_parser: str | None) -> ParsedRequest:
    max_tokens = body.get("max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"max_tokens: an integer >= 1 is required, got {max_tokens!r}", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
    budget = thinking_budget(body.get("thinking"))
    prompt = chat_prompt(chat_spec(body), tokenizer, tool_parser, reasoning_parser, id_prefix="toolu_")
    sampling = {"max_tokens": max_tokens, "stop": stops,
                **{k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}}
    params, name, given = sampling_params(sampling, 0, context_length, [len(prompt.ids)], prompt.json_schema,
                                          keep_special_tokens=prompt.output.reads_special_tokens)
    if budget is not None and prompt.output.reasoning_parser is not None:  # the output has a think block
        params = dataclasses.replace(params, thinking_budget=budget, think_end_ids=tokenizer.encode(
            think_format(prompt.output.reasoning_parser).close, add_bos=False))
    return ParsedRequest("messages", model, [prompt.ids], params, stream, False, name, given, output=prompt.output,
                         request_id=f"msg_{uuid.uuid4().hex[:24]}", created=int(time.time()))


def count_tokens(body: dict[str, Any], tokenizer) -> dict[str, int]:
    return {"input_tokens": len(chat_prompt(chat_spec(body), tokenizer).ids)}


# ---- replies ---------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(reason: str, tool_calls: bool, stop_sequence: str | None) -> str:
    if reason == "length":
        return "max_tokens"
    if tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(params_stop: list[str], full_text: str) -> str | None:
    """Which stop sequence ended the reply: the one that occurs first in the untruncated text (the
    engine cuts at the earliest occurrence of any), None if the reply ended at EOS instead."""
    hits = [(full_text.find(s), i) for i, s in enumerate(params_stop) if s in full_text]
    return params_stop[min(hits)[1]] if hits else None


def _input(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}


def message_response(req: ParsedRequest, out: ChatOutput, reason: str, stop_sequence: str | None,
                     prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not (out.reasoning or out.tool_calls):  # an empty reply is one empty text block
        content.append({"type": "text", "text": out.content})
    for call in out.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    return {"id": req.request_id, "type": "message", "role": "assistant", "model": req.model, "content": content,
            "stop_reason": stop_reason(reason, bool(out.tool_calls), stop_sequence), "stop_sequence": stop_sequence,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class MessageStream:
    """Anthropic's streaming events for one reply, as (event name, data) frames: `start`, `event` per
    engine event, then `end` (or `error`). Text, thinking and each tool call are content blocks,
    opened as their first delta arrives and closed when another kind begins or the reply ends."""

    done = False  # Anthropic streams end after message_stop, with no [DONE]

    def __init__(self, req: ParsedRequest, stop_sequence: Callable[[list[int], str], str | None]):
        self.req, self._stop_sequence = req, stop_sequence
        self.output = OutputStream(req.output)
        self._ids: list[int] = []
        self._started = False
        self._index = -1  # the open content block's index
        self._kind: str | None = None  # the open block's kind, "closed" after it ended
        self._frames: list[Frame] = []

    def start(self) -> list[Frame]:
        return []  # message_start goes with the first event, which knows the cached prompt tokens

    def event(self, event: StreamEvent, index: int = 0) -> list[Frame]:
        """index: the choice, always 0 (a message is one reply; OpenAIStream's signature)."""
        self._frames = []
        if not self._started:
            self._started = True
            message = {"id": self.req.request_id, "type": "message", "role": "assistant", "model": self.req.model,
                       "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": usage(event.prompt_tokens, 0, event.cached_tokens)}
            self._frames.append(("message_start", {"type": "message_start", "message": message}))
        self._ids.extend(event.token_ids)
        if event.text:
            self._piece(self.output.feed(event.text))
        return self._frames

    def end(self, final: StreamEvent) -> list[Frame]:
        self._frames = []
        self._piece(self.output.finish())
        if self._index < 0:  # an empty reply is one empty text block, as non-streamed
            self._open("text", {"type": "text", "text": ""})
        self._close()
        stop = self._stop_sequence(self._ids, final.finish_reason)
        self._frames.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(final.finish_reason, bool(self.output.calls), stop),
                      "stop_sequence": stop},
            "usage": {"output_tokens": final.completion_tokens}}))
        self._frames.append(("message_stop", {"type": "message_stop"}))
        return self._frames

    @staticmethod
    def error(message: str, status: int) -> list[Frame]:
        return [("error", {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}})]

    def _piece(self, piece: Piece) -> None:
        if piece.reasoning:
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.content:
            self._open("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": piece.content})
        for delta in piece.tool_calls:
            if "id" in delta:  # a new call: its own block
                self._open(f"tool_use {delta['index']}", {"type": "tool_use", "id": delta["id"],
                                                         "name": delta["function"]["name"], "input": {}})
            elif delta["function"]["arguments"]:
                self._delta({"type": "input_json_delta", "partial_json": delta["function"]["arguments"]})

    def _open(self, kind: str, block: dict[str, Any]) -> None:
        if self._kind == kind:
            return
        self._close()
        self._index += 1
        self._kind = kind
        self._frames.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                                     "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self._frames.append(("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                     "delta": delta}))

    def _close(self) -> None:
        if self._index < 0 or self._kind == "closed":
            return
        if self._kind == "thinking":  # clients expect a signature before a thinking block ends
            self._delta({"type": "signature_delta", "signature": ""})
        self._frames.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._kind = "closed"
