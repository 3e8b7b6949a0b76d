"""OpenAI request validation and response building: JSON in -> `ParsedRequest`, events -> JSON out.

Validation follows OpenAI's behaviour: wrong types and out-of-range values are a 400 naming the
offending parameter (by the name the client used, e.g. `max_completion_tokens`); unknown fields are
ignored. Sampling parameters beyond OpenAI's (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens) are accepted as SGLang and vLLM accept them.

max_tokens when the client gives none: chat gets the rest of the context (OpenAI's "until the
context ends"), capped by `DEFAULT_CHAT_MAX_TOKENS`; completions get 16, the legacy OpenAI default.
A prompt plus max_tokens beyond the context is a 400, as on OpenAI.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ktlite.errors import RequestError
from ktlite.runtime.sampling import SamplingParams, is_int, is_number

DEFAULT_CHAT_MAX_TOKENS = 1 << 20  # i.e. the context's end, whatever the model
DEFAULT_COMPLETION_MAX_TOKENS = 16
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# OpenAI name -> SamplingParams field, for the fields passed through unchanged.
_PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens")


class APIError(Exception):
    """An error the client sees as `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class ParsedRequest:
    kind: str  # "chat" or "completion"
    model: str
    prompts: list[list[int]]  # token ids, one list per prompt (chat: exactly one)
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_param: str  # the name the client used, for error messages
    max_tokens_given: bool
    echo_texts: list[str] = field(default_factory=list)  # completions with echo=true
    request_id: str = ""
    created: int = 0


def _get(body: dict[str, Any], name: str, check, expected: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad_request(f"{name} must be {expected}, got {value!r}"[:500], name)
    return value


def _message_content(content: Any, index: int) -> str | list[dict[str, Any]] | None:
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{param} parts must be objects with a 'type'", param)
            if part["type"] != "text":
                raise bad_request(f"{param}: content part type {part['type']!r} is not supported (text only)", param)
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{param}: a text part needs a string 'text'", param)
            parts.append(part["text"])
        return "".join(parts)  # templates expect a string
    raise bad_request(f"{param} must be a string or a list of content parts", param)


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise bad_request("'messages' is a required property", "messages")
    if not isinstance(messages, list):
        raise bad_request("messages must be a list of message objects", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}", f"messages[{i}].role")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _message_content(m.get("content"), i)
        if msg["content"] is None and not m.get("tool_calls"):
            if role in ("system", "developer", "user"):
                raise bad_request(f"messages[{i}].content is required", f"messages[{i}].content")
            msg["content"] = ""
        out.append(msg)
    return out


def _sampling(body: dict[str, Any], default_max_tokens: int, context_length: int, prompt_lens: list[int]
              ) -> tuple[SamplingParams, str, bool]:
    """-> (params, name of the max-tokens field the client used, whether it gave one)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    given = body.get(name) is not None
    max_tokens = body.get(name)
    if given and not (is_int(max_tokens) and max_tokens >= 1):
        raise bad_request(f"{name} must be an integer >= 1, got {max_tokens!r}", name)
    longest = max(prompt_lens)
    room = context_length - longest
    if given:
        if longest + max_tokens > context_length:
            raise bad_request(
                f"this model's maximum context length is {context_length} tokens; the prompt has {longest} tokens "
                f"and {name} is {max_tokens} ({longest + max_tokens} in all): lower {name} or shorten the prompt",
                name, "context_length_exceeded")
    else:
        max_tokens = max(1, min(default_max_tokens, room))
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    for key in _PASS_THROUGH:
        if body.get(key) is not None:
            kwargs[key] = body[key]
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop")
        kwargs["stop"] = [s for s in stop if s]  # OpenAI ignores empty stop strings
    try:
        params = SamplingParams(**kwargs)
    except RequestError as exc:
        param = name if exc.param == "max_tokens" else exc.param
        raise bad_request(str(exc).replace("max_tokens", name), param) from exc
    except TypeError as exc:  # e.g. a list where a number belongs, caught by validate's comparisons
        raise bad_request(f"invalid sampling parameter: {exc}") from exc
    return params, name, given


def _common(body: Any) -> None:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    n = body.get("n")
    if n is not None and (not is_int(n) or n < 1):
        raise bad_request(f"n must be an integer >= 1, got {n!r}", "n")
    if n is not None and n > 1:
        raise bad_request("n > 1 is not supported by ktlite; send n separate requests (they batch together)", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("best_of is not supported by ktlite", "best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported by ktlite yet", "logprobs")
    _get(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    _get(body, "user", lambda v: isinstance(v, str), "a string")
    so = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if so is not None:
        _get(so, "include_usage", lambda v: isinstance(v, bool), "a boolean")
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _get(body, key, is_number, "a number")
    for key in ("top_k", "seed", "min_tokens"):
        _get(body, key, is_int, "an integer")


def _include_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options") or {}
    return bool(so.get("include_usage"))


def parse_chat(body: Any, tokenizer, context_length: int, model: str) -> ParsedRequest:
    _common(body)
    messages = parse_messages(body.get("messages"))
    extra: dict[str, Any] = {}
    if body.get("tools"):
        extra["tools"] = body["tools"]  # rendered by the template; tool-call parsing is not done yet
    if isinstance(body.get("chat_template_kwargs"), dict):  # SGLang/vLLM: e.g. {"thinking": true}
        extra.update({k: v for k, v in body["chat_template_kwargs"].items()
                      if isinstance(k, str) and k not in ("messages", "add_generation_prompt")})
    try:
        ids = tokenizer.encode_chat(messages, **extra)
    except RequestError as exc:
        raise bad_request(str(exc), exc.param or "messages") from exc
    params, name, given = _sampling(body, DEFAULT_CHAT_MAX_TOKENS, context_length, [len(ids)])
    return ParsedRequest("chat", model, [ids], params, bool(body.get("stream")), _include_usage(body), name, given,
                         request_id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()))


def parse_completion(body: Any, tokenizer, vocab_size: int, context_length: int, model: str) -> ParsedRequest:
    _common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is a required property", "prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(is_int(t) for t in p)
                                                     for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                          "prompt")
    ids_list, echo_texts = [], []
    for p in prompts:
        if isinstance(p, str):
            ids_list.append(tokenizer.encode(p))
            echo_texts.append(p)
        else:
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")
            ids_list.append(list(p))
            echo_texts.append(tokenizer.decode(list(p)))
    stream = bool(body.get("stream"))
    if stream and len(ids_list) > 1:
        raise bad_request("streaming supports one prompt per request; send one request per prompt", "prompt")
    if body.get("suffix"):
        raise bad_request("suffix is not supported by ktlite", "suffix")
    echo = _get(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
    params, name, given = _sampling(body, DEFAULT_COMPLETION_MAX_TOKENS, context_length, [max(len(i), 1) for i in ids_list])
    return ParsedRequest("completion", model, ids_list, params, stream, _include_usage(body), name, given,
                         echo_texts=echo_texts if echo else [], request_id=f"cmpl-{uuid.uuid4().hex}",
                         created=int(time.time()))


# ---- responses ----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_finish_reason(reason: str | None) -> str | None:
    return reason  # "stop" and "length" are OpenAI's; "abort" only happens on shutdown


def chat_response(req: ParsedRequest, text: str, reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": req.request_id, "object": "chat.completion", "created": req.created, "model": req.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": openai_finish_reason(reason)}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_response(req: ParsedRequest, results: list[tuple[str, str, int, int]]) -> dict:
    """results: one (text, finish_reason, prompt_tokens, completion_tokens) per prompt."""
    choices, p_total, c_total = [], 0, 0
    for i, (text, reason, p, c) in enumerate(results):
        if req.echo_texts:
            text = req.echo_texts[i] + text
        choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(reason)})
        p_total, c_total = p_total + p, c_total + c
    return {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model,
            "choices": choices, "usage": usage(p_total, c_total)}


def chunk(req: ParsedRequest, *, text: str | None = None, role: bool = False, finish_reason: str | None = None,
          usage_: dict[str, int] | None = None, no_choices: bool = False) -> dict:
    """One streaming chunk. Chat chunks carry a `delta`; completion chunks carry `text`."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": openai_finish_reason(finish_reason)}
    else:
        obj = "text_completion"
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": openai_finish_reason(finish_reason)}
    out: dict[str, Any] = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
                           "choices": [] if no_choices else [choice]}
    if req.include_usage:
        out["usage"] = usage_  # null on every chunk but the last, as OpenAI does
    return out


def models_response(names: list[str], created: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "ktlite"}
                                       for n in names]}
