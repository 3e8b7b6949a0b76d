"""OpenAI's Responses API (`POST /v1/responses`) on the same engine, as Codex CLI drives it.

A request is translated into the chat terms the other APIs use (`ChatSpec`), so the template, the
grammar for forced calls and the reasoning and tool-call parsers are shared; only the JSON differs:
- `instructions` -> a leading system message (not carried over by `previous_response_id`, as on
  OpenAI); `input` (a string, or items) -> messages: `message` items of any role (`developer` ->
  system; text parts only: `input_text` / `output_text`), `reasoning` items -> `reasoning_content` of
  the assistant turn that follows, `function_call` items -> that turn's `tool_calls`,
  `function_call_output` -> `role: "tool"` messages. Images, files and other item types are refused (400).
- `tools`: `function` tools, and the function tools inside a `namespace` tool (offered by their own
  name; a call to one carries the `namespace` back). Tool types the engine cannot offer to a model
  (hosted `web_search`, `file_search`, `custom` freeform tools, `local_shell`, `mcp`...) are dropped,
  each type logged once, so the rest of the request still runs (Codex sends `web_search` every turn).
  `tool_choice` auto / none / required / {"type": "function", "name"} as in chat completions.
- `text.format` json_object / json_schema constrains the output; `max_output_tokens` caps it (default:
  the rest of the context); `temperature`, `top_p` and SGLang's extras (`top_k`, `stop`, ...) apply.
- `reasoning.effort` switches the template's thinking (the variables `thinking` and `enable_thinking`):
  "none" off, any other effort on; without an effort (Codex sends only `summary`) the template decides.
- Accepted and ignored: `include`, `prompt_cache_key` (the prefix cache works without it),
  `parallel_tool_calls`, `reasoning.summary` (reasoning is returned as text, never summarized),
  `text.verbosity`, `metadata` (echoed), `client_metadata`, `user`, `safety_identifier`, `truncation`,
  `service_tier`, `background` (runs in the foreground).
- Output items: `reasoning` (the reasoning parser's text as `reasoning_text` content, no summary,
  `encrypted_content` null: nothing is encrypted here), `message` (one `output_text` part),
  `function_call` (the tool-call parser's calls). A reply cut by max_output_tokens has status
  `incomplete` (`incomplete_details.reason` "max_output_tokens"). Usage: `input_tokens` (the whole
  prompt), `input_tokens_details.cached_tokens` (served by the prefix cache), `output_tokens`,
  `output_tokens_details.reasoning_tokens` (the reasoning text re-tokenized, at most `output_tokens`).
- Streaming: named SSE events with `type` and a running `sequence_number` (OpenAI's order:
  response.created, response.in_progress, then per item output_item.added, content_part.added,
  *.delta..., *.done, content_part.done, output_item.done, and response.completed / incomplete /
  failed); no `[DONE]`.
- State: with `store` true (the default) the finished response and its conversation are kept in memory,
  in an LRU of `STORED_RESPONSES` responses, for `previous_response_id`; an unknown or evicted id is a
  400 (`previous_response_not_found`). `store: false` (Codex's default: it resends the history) keeps
  nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ktlite.runtime.sampling import is_int
from ktlite.runtime.scheduler import StreamEvent
from ktlite.server.chat_output import OutputStream, Piece, new_id
from ktlite.server.protocol import (DEFAULT_CHAT_MAX_TOKENS, APIError, ChatSpec, Frame, ParsedRequest, bad_request,
                                    chat_prompt, parse_tools, sampling_params)

logger = logging.getLogger(__name__)

STORED_RESPONSES = 128  # previous_response_id targets kept (LRU): each holds its whole conversation


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation up to and including this response (no instructions)


class ResponseStore:
    """The stored responses (`store: true`), bounded: the least recently used goes beyond `capacity`."""

    def __init__(self, capacity: int = STORED_RESPONSES):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()  # the server's loop and test threads may both use it

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def put(self, response_id: str, item: Stored) -> None:
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ResponsesRequest(ParsedRequest):
    """A Responses request: the chat request plus what the reply echoes and what storing it needs."""

    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    history: list[dict[str, Any]] = field(default_factory=list)  # messages without the instructions
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace tool
    store: ResponseStore | None = None  # where the finished response goes (None: store false)


# ---- requests ------------------------------------------------------------------------------------
def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text") \
                or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}]: content part type {kind!r} is not supported (text parts only)",
                              f"{param}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _assistant(out: list[dict[str, Any]], fresh: bool) -> dict[str, Any]:
    """The assistant message an output item belongs to: the last one if it is still open (a reasoning
    item, then text, then calls make one turn), else a new one."""
    last = out[-1] if out else None
    if last is None or last["role"] != "assistant" or (fresh and (last["content"] or last.get("tool_calls"))):
        last = {"role": "assistant", "content": ""}
        out.append(last)
    return last


def input_messages(items: Any, param: str = "input") -> list[dict[str, Any]]:
    """`input` (a string or a list of items) -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request(f"{param} must be a string or a list of input items", param)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant; got {role!r}",
                                  f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                _assistant(out, fresh=True)["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            message = _assistant(out, fresh=True)
            message["reasoning_content"] = message.get("reasoning_content", "") + _text(parts, f"{where}.content")
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs string call_id, name and arguments", where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            _assistant(out, fresh=False).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{where}.output")})
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported (message, reasoning, "
                              "function_call and function_call_output are)", where)
    return out


@functools.cache
def _log_dropped(kind: str) -> None:
    """Logs once per tool type and process (the cache makes later calls no-ops)."""
    logger.info("responses: dropped the %r tools of a request: only function tools can be offered to the model", kind)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tools(value: Any) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
    """`tools` -> (chat function tools, function name -> namespace); other tool types are dropped."""
    if value is None:
        return None, {}
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise bad_request("tools must be a list of tool objects", "tools")
    tools, namespaces = [], {}
    for tool in value:
        kind = tool.get("type")
        if kind == "function":
            tools.append(_function(tool))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    tools.append(_function(inner))
                    namespaces[inner.get("name")] = tool.get("name")
                else:
                    _log_dropped(f"{inner.get('type') if isinstance(inner, dict) else None} (in a namespace)")
        else:
            _log_dropped(str(kind))
    return parse_tools(tools), namespaces


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    if value is None or value in ("auto", "none"):
        return value or "auto", None
    if value == "required":
        choice, name = "required", None
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        choice, name = "required", value["name"]
    else:
        raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                          "tool_choice")
    if not tools:
        raise bad_request("tool_choice requires a tool call but no function tools were given", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return choice, name


def _text_schema(value: Any) -> dict[str, Any] | None:
    """`text.format` -> the JSON schema to enforce (None for plain text); `text.verbosity` is ignored."""
    fmt = value.get("format") if isinstance(value, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return fmt["schema"]
    raise bad_request('text.format must be {"type": "text" | "json_object"} or {"type": "json_schema", '
                      '"schema": {...}}', "text.format")


def _thinking(value: Any) -> dict[str, Any]:
    """`reasoning.effort` -> the template's thinking switch (both names templates use); none without an effort."""
    effort = value.get("effort") if isinstance(value, dict) else None
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise bad_request("reasoning.effort must be a string", "reasoning.effort")
    on = effort != "none"
    return {"thinking": on, "enable_thinking": on}


def _history(body: dict[str, Any], store: ResponseStore) -> list[dict[str, Any]]:
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    stored = store.get(previous) if isinstance(previous, str) else None
    if stored is None:
        raise bad_request(f"Previous response with id {previous!r} not found (this server keeps the last "
                          f"{store.capacity} stored responses, in memory)", "previous_response_id",
                          "previous_response_not_found")
    return stored.messages


def parse_request(body: dict[str, Any], tokenizer, context_length: int, model: str, tool_parser: str | None,
                  reasoning_parser: str | None, store: ResponseStore) -> ResponsesRequest:
    stream, keep = body.get("stream", False), body.get("store", True)
    if not isinstance(stream, bool) or not isinstance(keep, bool):
        raise bad_request("stream and store must be booleans", "stream" if not isinstance(stream, bool) else "store")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise bad_request(f"max_output_tokens must be an integer >= 1, got {max_tokens!r}", "max_output_tokens")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    if body.get("input") is None:
        raise bad_request("'input' is a required property", "input")
    history = _history(body, store) + input_messages(body["input"])
    if not history:
        raise bad_request("input must not be empty", "input")
    tools, namespaces = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    spec = ChatSpec(messages, tools, choice, name, response_schema=_text_schema(body.get("text")),
                    template_kwargs=_thinking(body.get("reasoning")))
    prompt = chat_prompt(spec, tokenizer, tool_parser, reasoning_parser)
    sampling = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
    try:
        params, _, given = sampling_params({**sampling, "max_tokens": max_tokens}, DEFAULT_CHAT_MAX_TOKENS, context_length,
                                           [len(prompt.ids)], prompt.json_schema,
                                           keep_special_tokens=prompt.output.reads_special_tokens)
    except APIError as exc:  # name the field as this API calls it
        if exc.param == "max_tokens":
            exc.param, exc.message = "max_output_tokens", exc.message.replace("max_tokens", "max_output_tokens")
        raise
    echo = {"instructions": instructions, "previous_response_id": body.get("previous_response_id"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "max_output_tokens": max_tokens,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "metadata": body.get("metadata") or {}, "store": keep,
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None}}
    return ResponsesRequest("responses", model, [prompt.ids], params, stream, False, "max_output_tokens", given,
                            output=prompt.output, request_id=f"resp_{uuid.uuid4().hex}", created=int(time.time()),
                            echo=echo, history=history, namespaces=namespaces, store=store if keep else None)


# ---- replies ---------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def error_event(message: str, status: int) -> dict[str, Any]:
    return {"code": "server_error" if status != 503 else "aborted", "message": message}


class ResponseStream:
    """The Responses events of one reply, as (event name, data) frames: `start`, `event` per engine
    event, then `end` (or `error`); `response` is the final response object after `end`. Reasoning,
    the message and each function call are output items, opened as their first delta arrives and
    closed when another begins or the reply ends. A whole reply is one `event` plus `end`."""

    done = False  # Responses streams end after response.completed, with no [DONE]

    def __init__(self, req: ResponsesRequest, count_tokens: Callable[[str], int]):
        self.req, self._count = req, count_tokens
        self.output = OutputStream(req.output)
        self.items: list[dict[str, Any]] = []  # output items, completed as they close
        self._open_kind: str | None = None  # "reasoning", "message", "call N" while an item is open
        self._seq = 0
        self._frames: list[Frame] = []
        self.response: dict[str, Any] | None = None

    def start(self) -> list[Frame]:
        self._frames = []
        skeleton = self._response("in_progress", None)
        self._emit("response.created", response=skeleton)
        self._emit("response.in_progress", response=skeleton)
        return self._frames

    def event(self, event: StreamEvent, index: int = 0) -> list[Frame]:
        """`index`: the choice (always 0: a response has one output)."""
        return self._frames_of(self.output.feed(event.text)) if event.text else []

    def end(self, final: StreamEvent) -> list[Frame]:
        incomplete = final.finish_reason == "length"
        self._frames_of(self.output.finish())
        self._close("incomplete" if incomplete else "completed")
        reasoning = "".join(c["text"] for item in self.items if item["type"] == "reasoning" for c in item["content"])
        thought = min(self._count(reasoning), final.completion_tokens) if reasoning else 0  # re-tokenizing may differ
        self.response = self._response("incomplete" if incomplete else "completed", usage(
            final.prompt_tokens, final.completion_tokens, final.cached_tokens, thought))
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self._emit("response.incomplete" if incomplete else "response.completed", response=self.response)
        if self.req.store is not None:
            messages = self.req.history + input_messages(self.items, "output")
            self.req.store.put(self.req.request_id, Stored(self.response, messages))
        return self._frames

    def error(self, message: str, status: int) -> list[Frame]:
        self._frames = []
        failed = self._response("failed", None)
        failed["error"] = error_event(message, status)
        self._emit("response.failed", response=failed)
        return self._frames

    def _response(self, status: str, usage_: dict[str, Any] | None) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        return {"id": self.req.request_id, "object": "response", "created_at": self.req.created, "status": status,
                "completed_at": int(time.time()) if done else None, "error": None, "incomplete_details": None,
                "model": self.req.model, "output": list(self.items) if done else [], "usage": usage_,
                "truncation": "disabled", "user": None, **self.req.echo}

    def _frames_of(self, piece: Piece) -> list[Frame]:
        self._frames = []
        self._piece(piece)
        return self._frames

    def _emit(self, kind: str, **data: Any) -> None:
        self._frames.append((kind, {"type": kind, "sequence_number": self._seq, **data}))
        self._seq += 1

    # the open item is always the last of self.items; its index is its output_index
    def _piece(self, piece: Piece) -> None:
        if piece.reasoning:
            self._open("reasoning", {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": [],
                                     "encrypted_content": None}, {"type": "reasoning_text", "text": ""})
            self._text_delta("response.reasoning_text.delta", piece.reasoning)
        if piece.content:
            self._open("message", {"type": "message", "id": new_id("msg_"), "role": "assistant", "content": []},
                       {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self._text_delta("response.output_text.delta", piece.content)
        for delta in piece.tool_calls:
            if "id" in delta:  # a new call: its own item
                name = delta["function"]["name"]
                item = {"type": "function_call", "id": new_id("fc_"), "call_id": delta["id"], "name": name,
                        "arguments": ""}
                if name in self.req.namespaces:
                    item["namespace"] = self.req.namespaces[name]
                self._open(f"call {delta['index']}", item, None)
            elif delta["function"]["arguments"]:
                item = self.items[-1]
                item["arguments"] += delta["function"]["arguments"]
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=len(self.items) - 1, delta=delta["function"]["arguments"])

    def _open(self, kind: str, item: dict[str, Any], part: dict[str, Any] | None) -> None:
        if self._open_kind == kind:
            return
        self._close()
        self._open_kind = kind
        self.items.append({**item, "status": "in_progress"})
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=dict(self.items[-1]))
        if part is not None:
            self._emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                       part=dict(part))
            self.items[-1]["content"] = [part]

    def _text_delta(self, kind: str, text: str) -> None:
        item = self.items[-1]
        item["content"][0]["text"] += text
        self._emit(kind, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text,
                   **({"logprobs": []} if kind == "response.output_text.delta" else {}))

    def _close(self, status: str = "completed") -> None:
        """Close the open item; `status` "incomplete" for the one max_output_tokens cut."""
        if self._open_kind is None:
            return
        self._open_kind = None
        item, index = self.items[-1], len(self.items) - 1
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[])
            else:
                self._emit("response.reasoning_text.done", **ids, content_index=0, text=part["text"])
            self._emit("response.content_part.done", **ids, content_index=0, part=dict(part))
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=dict(item))


def response_object(req: ResponsesRequest, text: str, final: StreamEvent,
                    count_tokens: Callable[[str], int]) -> dict[str, Any]:
    """The non-streamed response: the same items and object the stream ends with."""
    stream = ResponseStream(req, count_tokens)
    stream.start()
    stream.event(StreamEvent(text, []))
    stream.end(final)
    return stream.response
