"""OpenAI request validation and response building: JSON in -> `ParsedRequest`, events -> JSON out.

Validation follows OpenAI's behaviour: wrong types and out-of-range values are a 400 naming the
offending parameter (by the name the client used, e.g. `max_completion_tokens`); unknown fields are
ignored. Sampling parameters beyond OpenAI's (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens) are accepted as SGLang and vLLM accept them.

max_tokens when the client gives none: chat gets the rest of the context (OpenAI's "until the
context ends"), capped by `DEFAULT_CHAT_MAX_TOKENS`; completions get 16, the legacy OpenAI default.
A prompt plus max_tokens beyond the context is a 400, as on OpenAI.

Chat extras (`ChatSpec`, shared with the Anthropic API): `tools` go to the chat template unless
`tool_choice` is "none" (then the model is not told about them and nothing is parsed); with "auto"
the server's `--tool-call-parser` takes calls out of the text; "required" or a named function
constrain the output by grammar to one call (see chat_output.py). `response_format` json_object /
json_schema constrain it to compact JSON (see ktlite/runtime/grammar.py). `--reasoning-parser` splits
thinking into `reasoning_content` unless `separate_reasoning` is false; a grammar-constrained output
is all answer, so it is not split. `chat_template_kwargs` reach the template as variables.

Logprobs: chat `logprobs: true` (+ `top_logprobs` 0..20), completions `logprobs: 0..5`, streamed or
not (each chunk carries its own tokens'). Values are the log-softmax of the model's raw logits, its
own distribution before temperature, penalties and grammar masks (vLLM's default too), so the
sampled token's logprob does not depend on the sampling settings (ktlite/runtime/logprobs.py).
Completions with `echo` and `logprobs` also return the prompt tokens' logprobs (the first is null);
there `max_tokens` may be 0 (prefill only, finish_reason "length"); elsewhere max_tokens must be
>= 1. lm-eval's loglikelihood requests (0.4.13) send echo, logprobs 1 and max_tokens 1, and drop the
sampled token's entry. Shapes: see logprob_shapes.py.

`n` (1..128) choices per prompt; completions with several prompts number them prompt_i * n + j.
`best_of` (completions, >= n): that many samples per prompt, of which the n with the highest
cumulative logprob are returned (not streamable when best_of > n, as on OpenAI). Sample j > 0 uses
seed + j when a seed is given, so the choices differ and stay reproducible.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ktlite.errors import RequestError
from ktlite.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ktlite.runtime.sampling import SamplingParams, is_int, is_number
from ktlite.server.chat_output import OutputPlan, OutputStream, Piece, forced_call_schema, parse_output
from ktlite.server.logprob_shapes import LogprobShapes
from ktlite.server.reasoning import prompt_opens_think

Frame = tuple[str | None, dict[str, Any]]  # one server-sent event: (event name or None, data)

DEFAULT_CHAT_MAX_TOKENS = 1 << 20  # i.e. the context's end, whatever the model
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_CHOICES = 128  # OpenAI's limit for n
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit for logprobs
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
    kind: str  # "chat", "completion", "messages" (anthropic.py) or "responses" (responses.py)
    model: str
    prompts: list[list[int]]  # token ids, one list per prompt (chat: exactly one)
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_param: str  # the name the client used, for error messages
    max_tokens_given: bool
    echo_texts: list[str] = field(default_factory=list)  # completions with echo=true
    output: OutputPlan = field(default_factory=OutputPlan)  # chat: how the text becomes reasoning/content/calls
    request_id: str = ""
    created: int = 0
    n: int = 1  # choices per prompt
    best_of: int = 1  # samples per prompt the n choices are chosen from
    top_logprobs: int | None = None  # logprobs in the reply, with this many alternatives; None: none
    shapes: LogprobShapes | None = None  # how logprobs are written (set with top_logprobs)


@dataclass
class Collected:
    """One choice's whole reply."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # with echo: of the prompt's tokens 1..
    prompt_ids: list[int] = field(default_factory=list)


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


def sampling_params(body: dict[str, Any], default_max_tokens: int, context_length: int, prompt_lens: list[int],
                    json_schema: dict[str, Any] | None = None,
                    logprobs: dict[str, Any] | None = None,
                    keep_special_tokens: bool = False) -> tuple[SamplingParams, str, bool]:
    """-> (params, name of the max-tokens field the client used, whether it gave one). `logprobs`:
    the SamplingParams logprob fields (`_logprob_fields`); `keep_special_tokens`: the output's parsers need them
    (OutputPlan.reads_special_tokens), whatever the client asked."""
    logprobs = logprobs or {}
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    given = body.get(name) is not None
    max_tokens = body.get(name)
    least = 0 if logprobs.get("prompt_logprobs") else 1  # 0: score the echoed prompt only
    if given and not (is_int(max_tokens) and max_tokens >= least):
        raise bad_request(f"{name} must be an integer >= {least}, got {max_tokens!r}"
                          + (" (0 only on completions with echo and logprobs)" if least else ""), name)
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
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "json_schema": json_schema, **logprobs}
    for key in _PASS_THROUGH:
        if body.get(key) is not None:
            kwargs[key] = body[key]
    if keep_special_tokens:
        kwargs["skip_special_tokens"] = False
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
    _get(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    _get(body, "user", lambda v: isinstance(v, str), "a string")
    so = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if so is not None:
        _get(so, "include_usage", lambda v: isinstance(v, bool), "a boolean")
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _get(body, key, is_number, "a number")
    for key in ("top_k", "seed", "min_tokens"):
        _get(body, key, is_int, "an integer")


def _choices(body: dict[str, Any], best_of_allowed: bool) -> tuple[int, int]:
    """-> (n, best_of): choices per prompt and the samples they are chosen from."""
    n = _get(body, "n", lambda v: is_int(v) and 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]", 1)
    if not best_of_allowed:
        return n, n
    best_of = _get(body, "best_of", lambda v: is_int(v) and n <= v <= MAX_CHOICES,
                   f"an integer in [n, {MAX_CHOICES}] (n is {n})", n)
    if best_of > n and body.get("stream"):
        raise bad_request("best_of > n cannot be streamed: the choices are known only at the end", "best_of")
    return n, best_of


def _logprob_fields(top: int | None, prompt: bool, best_of: bool) -> dict[str, Any]:
    """SamplingParams' logprob fields: `top` alternatives per token in the reply (None: no logprobs);
    prompt: the echoed prompt's too; best_of: sampled logprobs to rank the samples by."""
    return {"logprobs": top is not None or best_of, "top_logprobs": top or 0,
            "prompt_logprobs": prompt}


def _include_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options") or {}
    return bool(so.get("include_usage"))


@dataclass
class ChatSpec:
    """A chat request in the terms both APIs share (OpenAI shapes for messages and tools)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # "auto", "none" or "required"
    tool_name: str | None = None  # a named function (tool_choice {"type": "function", ...})
    response_schema: dict[str, Any] | None = None  # response_format json_object / json_schema
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    separate_reasoning: bool = True


@dataclass
class ChatPrompt:
    ids: list[int]
    output: OutputPlan
    json_schema: dict[str, Any] | None  # what the grammar enforces, if anything


def parse_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
    return tools or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """OpenAI `tool_choice` -> ("auto" | "none" | "required", function name or None)."""
    if value is None:
        return "auto", None
    if value in ("auto", "none", "required"):
        choice, name = value, None
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        choice, name = "required", value["function"]["name"]
    else:
        raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                          f'{{"name": ...}}}}, got {value!r}'[:300], "tool_choice")
    if choice == "required" and not tools:
        raise bad_request("tool_choice requires a tool call but no tools were given", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return choice, name


def _response_schema(value: Any) -> dict[str, Any] | None:
    """OpenAI `response_format` -> the JSON schema to enforce (None for plain text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        return schema
    raise bad_request('response_format.type must be "text", "json_object" or "json_schema"', "response_format")


def chat_spec(body: dict[str, Any]) -> ChatSpec:
    """The OpenAI chat body's messages, tools and output options."""
    tools = parse_tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    separate = _get(body, "separate_reasoning", lambda v: isinstance(v, bool), "a boolean", True)
    return ChatSpec(parse_messages(body.get("messages")), tools, choice, name,
                    _response_schema(body.get("response_format")), dict(kwargs), separate)


def _late_system_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the conversation began (Claude Code's mid-conversation system messages),
    as user messages in place: for templates that refuse a system message anywhere but the start. In
    place, so consecutive turns still share their prompt prefix."""
    out, started = [], False
    for m in messages:
        started = started or m.get("role") != "system"
        out.append({**m, "role": "user"} if started and m.get("role") == "system" else m)
    return out


def chat_prompt(spec: ChatSpec, tokenizer, tool_parser: str | None = None, reasoning_parser: str | None = None,
                id_prefix: str = "call_") -> ChatPrompt:
    """Render the template and decide how the output is constrained and taken apart."""
    forced = spec.tool_choice == "required"
    if forced and spec.response_schema is not None:
        raise bad_request("response_format cannot be combined with a required or named tool_choice: the output is "
                          "then a tool call", "response_format")
    tools = spec.tools if spec.tool_choice != "none" else None
    kwargs = {k: v for k, v in spec.template_kwargs.items()
              if isinstance(k, str) and k not in ("messages", "tools", "add_generation_prompt")}
    try:
        text = tokenizer.render_chat(spec.messages, tools=tools, **kwargs)
    except RequestError as exc:
        late = _late_system_as_user(spec.messages)
        if late == spec.messages:
            raise bad_request(str(exc), exc.param or "messages") from exc
        try:  # templates that take a system message only at the start ("must be at the beginning")
            text = tokenizer.render_chat(late, tools=tools, **kwargs)
        except RequestError:
            raise bad_request(str(exc), exc.param or "messages") from exc
    schema = forced_call_schema(tools, spec.tool_name) if forced else spec.response_schema
    split = bool(reasoning_parser) and spec.separate_reasoning and schema is None  # a grammar output is all answer
    plan = OutputPlan(reasoning_parser if split else None,
                      split and prompt_opens_think(reasoning_parser, text),
                      tool_parser if tools and not forced else None, tools, forced, id_prefix)
    return ChatPrompt(tokenizer.encode(text, add_bos=False), plan, schema)  # the template wrote the BOS


def parse_chat(body: Any, tokenizer, context_length: int, model: str, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> ParsedRequest:
    _common(body)
    n, _ = _choices(body, best_of_allowed=False)
    wanted = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    top = _get(body, "top_logprobs", lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
               f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top is not None and not wanted:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    top = (top or 0) if wanted else None
    prompt = chat_prompt(chat_spec(body), tokenizer, tool_call_parser, reasoning_parser)
    params, name, given = sampling_params(body, DEFAULT_CHAT_MAX_TOKENS, context_length, [len(prompt.ids)],
                                          prompt.json_schema, _logprob_fields(top, False, False),
                                          prompt.output.reads_special_tokens)
    return ParsedRequest("chat", model, [prompt.ids], params, bool(body.get("stream")), _include_usage(body), name,
                         given, output=prompt.output, request_id=f"chatcmpl-{uuid.uuid4().hex}",
                         created=int(time.time()), n=n, best_of=n, top_logprobs=top,
                         shapes=LogprobShapes(tokenizer) if wanted else None)


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
    n, best_of = _choices(body, best_of_allowed=True)
    top = _get(body, "logprobs", lambda v: is_int(v) and 0 <= v <= MAX_COMPLETION_LOGPROBS,
               f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] or null")
    fields = _logprob_fields(top, echo and top is not None, best_of > n)
    params, name, given = sampling_params(body, DEFAULT_COMPLETION_MAX_TOKENS, context_length,
                                          [max(len(i), 1) for i in ids_list], logprobs=fields)
    return ParsedRequest("completion", model, ids_list, params, stream, _include_usage(body), name, given,
                         echo_texts=echo_texts if echo else [], request_id=f"cmpl-{uuid.uuid4().hex}",
                         created=int(time.time()), n=n, best_of=best_of, top_logprobs=top,
                         shapes=LogprobShapes(tokenizer) if top is not None else None)


# ---- responses ----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache served (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_finish_reason(reason: str | None, tool_calls: bool = False) -> str | None:
    """"stop" and "length" are OpenAI's ("abort" only happens on shutdown); a reply that ended by
    itself after tool calls is "tool_calls"."""
    return "tool_calls" if tool_calls and reason == "stop" else reason


def pick_choices(req: ParsedRequest, samples: list[Collected]) -> list[Collected]:
    """One prompt's n choices from its samples: of best_of samples the n with the highest cumulative
    logprob (best first); a prefill-only request's one sample n times. Every choice gets the prompt's
    logprobs, which sample 0 computed."""
    prompt = samples[0].prompt_logprobs
    if len(samples) > req.n:
        samples = sorted(samples, key=lambda r: sum(lp.logprob for lp in r.logprobs), reverse=True)[:req.n]
    return [dataclasses.replace(r, prompt_logprobs=prompt) for r in samples * (req.n // len(samples))]


def choices_usage(req: ParsedRequest, results: list[Collected]) -> dict[str, Any]:
    """Usage over a request's choices: each prompt counted once (its first choice's), every output token."""
    firsts = results[::req.n]
    return usage(sum(r.prompt_tokens for r in firsts), sum(r.completion_tokens for r in results),
                 sum(r.cached_tokens for r in firsts))


def chat_response(req: ParsedRequest, results: list[Collected]) -> dict:
    """results: one per choice, in index order."""
    choices = []
    for i, r in enumerate(results):
        out = parse_output(req.output, r.text)
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if req.output.reasoning_parser:
            message["reasoning_content"] = out.reasoning or None
        if out.tool_calls:
            message["content"] = out.content or None  # OpenAI: null beside tool calls when there is no text
            message["tool_calls"] = [c.openai() for c in out.tool_calls]
        logprobs = req.shapes.chat(r.logprobs, req.top_logprobs) if req.shapes is not None else None
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": openai_finish_reason(r.finish_reason, bool(out.tool_calls))})
    return {"id": req.request_id, "object": "chat.completion", "created": req.created, "model": req.model,
            "choices": choices, "usage": choices_usage(req, results)}


def completion_response(req: ParsedRequest, results: list[Collected]) -> dict:
    """results: one per choice, in index order (prompt_i * n + j)."""
    choices = []
    for i, r in enumerate(results):
        echo = req.echo_texts[i // req.n] if req.echo_texts else ""
        choices.append({"index": i, "text": echo + r.text, "logprobs": _completion_logprobs(req, r),
                        "finish_reason": openai_finish_reason(r.finish_reason)})
    return {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model,
            "choices": choices, "usage": choices_usage(req, results)}


def _completion_logprobs(req: ParsedRequest, r: Collected) -> dict[str, Any] | None:
    if req.shapes is None:
        return None
    if r.prompt_logprobs is None:
        return req.shapes.completion(r.logprobs, req.top_logprobs)
    return req.shapes.completion(r.prompt_logprobs + r.logprobs, req.top_logprobs, first=r.prompt_ids[0])


def chunk(req: ParsedRequest, *, text: str | None = None, role: bool = False, finish_reason: str | None = None,
          usage_: dict[str, Any] | None = None, no_choices: bool = False, reasoning: str | None = None,
          tool_calls: list[dict[str, Any]] | None = None, index: int = 0,
          logprobs: dict[str, Any] | None = None) -> dict:
    """One streaming chunk. Chat chunks carry a `delta` (content, reasoning_content, tool_calls);
    completion chunks carry `text`; either may carry its tokens' `logprobs`."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": openai_finish_reason(finish_reason)}
    else:
        obj = "text_completion"
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": openai_finish_reason(finish_reason)}
    out: dict[str, Any] = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
                           "choices": [] if no_choices else [choice]}
    if req.include_usage:
        out["usage"] = usage_  # null on every chunk but the last, as OpenAI does
    return out


class _ChoiceState:
    """One streamed choice: its output pipeline (chat), and logprobs of tokens not yet in a chunk."""

    def __init__(self, req: ParsedRequest):
        self.output = OutputStream(req.output) if req.kind == "chat" else None
        self.pending: list[TokenLogprob] = []
        self.echo_pending = bool(req.echo_texts)  # completions: the echo chunk goes out with the first event
        self.offset = 0  # completions: text_offset so far


class OpenAIStream:
    """The chunks of one streamed OpenAI request, as frames: `start`, `event` per engine event of
    choice `index`, then `end` with each choice's final event (or `error`), followed by
    `data: [DONE]`. Chat text goes through the request's output pipeline, so reasoning and tool calls
    arrive as `reasoning_content` and `tool_calls` deltas. Logprobs ride on the chunk that carries
    their tokens' text (or the next one, where the pipeline holds text back)."""

    done = True

    def __init__(self, req: ParsedRequest):
        self.req = req
        self.choices = [_ChoiceState(req) for _ in range(req.n)]
        # echo: the prompt's logprobs, from the first choice's first event (the other choices reuse them)
        self.prompt_logprobs: list[TokenLogprob] | None = None

    def start(self) -> list[Frame]:
        if self.req.kind == "chat":
            return [(None, chunk(self.req, role=True, index=j)) for j in range(self.req.n)]
        return []

    def event(self, event, index: int = 0) -> list[Frame]:
        state = self.choices[index]
        frames = []
        if state.echo_pending:
            state.echo_pending = False
            echo = self._echo_logprobs(event)
            state.offset = sum(map(len, echo["tokens"])) if echo else 0
            frames.append((None, chunk(self.req, text=self.req.echo_texts[0], index=index, logprobs=echo)))
        if self.req.shapes is not None:
            state.pending += event.logprobs
        if not event.text:
            return frames
        if state.output is None:
            return frames + [(None, chunk(self.req, text=event.text, index=index, logprobs=self._take(state)))]
        return frames + self._piece(state.output.feed(event.text), index)

    def end(self, *finals) -> list[Frame]:
        """finals: each choice's last event, in index order."""
        frames = []
        for j, (state, final) in enumerate(zip(self.choices, finals)):
            if state.output is not None:
                frames += self._piece(state.output.finish(), j)
            calls = state.output is not None and bool(state.output.calls)
            frames.append((None, chunk(self.req, finish_reason=openai_finish_reason(final.finish_reason, calls),
                                       index=j, logprobs=self._take(state))))
        if self.req.include_usage:
            firsts = finals[::self.req.n]
            frames.append((None, chunk(self.req, no_choices=True, usage_=usage(
                sum(f.prompt_tokens for f in firsts), sum(f.completion_tokens for f in finals),
                sum(f.cached_tokens for f in firsts)))))
        return frames

    @staticmethod
    def error(message: str, status: int) -> list[Frame]:
        code = "aborted" if status == 503 else "internal_error"
        return [(None, {"error": {"message": message, "type": "server_error", "param": None, "code": code}})]

    def _echo_logprobs(self, event) -> dict[str, Any] | None:
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if self.req.shapes is None or self.prompt_logprobs is None:
            return None
        return self.req.shapes.completion(self.prompt_logprobs, self.req.top_logprobs, first=self.req.prompts[0][0])

    def _take(self, state: _ChoiceState) -> dict[str, Any] | None:
        """The pending logprobs as this chunk's logprobs object (None when logprobs are off)."""
        if self.req.shapes is None:
            return None
        lps, state.pending = state.pending, []
        if state.output is not None:
            return self.req.shapes.chat(lps, self.req.top_logprobs)
        out = self.req.shapes.completion(lps, self.req.top_logprobs, offset=state.offset)
        state.offset += sum(map(len, out["tokens"]))
        return out

    def _piece(self, piece: Piece, index: int) -> list[Frame]:
        if not (piece.content or piece.reasoning or piece.tool_calls):
            return []
        return [(None, chunk(self.req, text=piece.content or None, reasoning=piece.reasoning or None,
                             tool_calls=piece.tool_calls, index=index, logprobs=self._take(self.choices[index])))]


def models_response(names: list[str], created: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "ktlite"}
                                       for n in names]}
