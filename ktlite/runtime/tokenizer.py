"""Tokenizer, chat template and streaming detokenization for an HF model folder.

The chat template comes from `chat_template.jinja` (recent transformers) or `tokenizer_config.json`
(hub folders; a string or a list of named templates) and is rendered in a sandboxed jinja2
environment, as transformers does: `messages`, `tools` (OpenAI's list of {"type": "function",
"function": {...}}), `add_generation_prompt`, the special tokens, and any extra keyword (the API's
`chat_template_kwargs`, e.g. `enable_thinking`, `thinking`).

Assistant `tool_calls` in the history carry `function.arguments` as a JSON string (OpenAI's shape),
while templates disagree on what they expect: some concatenate it as text, others iterate it as a
mapping (`arguments.items()`, `arguments|items`) or `tojson` it. It is rendered as `ToolArguments`, a
string that is also a read-only mapping of the parsed object, so every kind of template works.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ktlite.errors import CheckpointError, RequestError
from ktlite.runtime.tiktoken_tokenizer import TIKTOKEN_FILE, TiktokenBackend

REPLACEMENT_CHAR = "\ufffd"


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class ToolArguments(str):
    """A tool call's JSON arguments: the JSON text itself, and a read-only mapping of its object."""

    def __new__(cls, text: str, parsed: dict[str, Any]):
        obj = super().__new__(cls, text)
        obj.parsed = parsed
        return obj

    def __getitem__(self, key):  # a str key reads the mapping; ints and slices index the text
        return self.parsed[key] if isinstance(key, str) else str.__getitem__(self, key)

    def keys(self):
        return self.parsed.keys()

    def values(self):
        return self.parsed.values()

    def items(self):
        return self.parsed.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self.parsed.get(key, default)


Mapping.register(ToolArguments)  # so jinja's `is mapping` and `|items` accept it


def _with_tool_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages whose tool_calls' JSON-object arguments are ToolArguments."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_call_with_arguments(c) for c in calls]}
        out.append(message)
    return out


def _call_with_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**fn, "arguments": ToolArguments(args, parsed)}}


def _plain(value: Any) -> Any:
    """ToolArguments -> their object, recursively (for tojson)."""
    if isinstance(value, ToolArguments):
        return value.parsed
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, **_: Any) -> str:
    """transformers' `tojson` filter: unicode kept, optional indent/separators/sort_keys."""
    return json.dumps(_plain(value), ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _load_chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        config_path = model_dir / "tokenizer_config.json"
        tok_config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if path.is_file():
            self._tok = HFTokenizer.from_file(str(path))
        elif (model_dir / TIKTOKEN_FILE).is_file():  # tiktoken.model: the same interface, by tiktoken
            self._tok = TiktokenBackend(model_dir, tok_config)
        else:
            raise CheckpointError(f"{path} not found: ktlite needs a fast-tokenizer tokenizer.json (or a "
                                  f"{TIKTOKEN_FILE}) in the model folder")
        self.bos_token = _token_text(tok_config.get("bos_token"))
        self.eos_token = _token_text(tok_config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(tok_config.get("add_bos_token", self.bos_token_id is not None))
        self.eos_token_ids = self._eos_ids(model_dir)
        source = _load_chat_template(model_dir, tok_config)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._chat_template = env.from_string(source) if source else None

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids: list[int] = []
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            ids.append(self._tok.token_to_id(self.eos_token))
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            value = json.loads(gen_path.read_text()).get("eos_token_id")
            for v in [value] if isinstance(value, int) else value or []:
                if v not in ids:
                    ids.append(int(v))
        return tuple(ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def backend_json(self) -> str:
        """The tokenizer.json text (grammar engines read the vocabulary's byte encoding from it)."""
        return self._tok.to_str()

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) renders it."""
        if self._chat_template is None:
            raise RequestError("this model has no chat template; use the completions API with a plain prompt", "messages")
        try:
            return self._chat_template.render({
                **template_kwargs,  # the request's variables; the ones below are not theirs to set
                "messages": _with_tool_arguments(messages),
                "tools": tools,  # None when absent, as transformers passes it
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            })
        except (jinja2.exceptions.TemplateError, TypeError) as exc:  # TypeError: e.g. a message field of the wrong type
            raise RequestError(f"chat template rejected the messages: {exc}", "messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
        # the template writes the BOS token itself
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **template_kwargs), add_bos=False)

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas whose concatenation equals decode(all ids).

    Byte-level tokens can split one UTF-8 character; such a tail decodes to U+FFFD, so the delta is
    held back until the character completes. A few previous tokens are decoded along with the new
    ones because some decoders (e.g. sentencepiece spaces) depend on the left context.
    """

    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0  # start of the context window within _ids
        self._read_offset = len(self._ids)  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix, full = self._decode(self._read_offset), self._decode(len(self._ids))
        if full.endswith(REPLACEMENT_CHAR) or len(full) < len(prefix) or not full.startswith(prefix):
            return ""  # an incomplete character: wait for more bytes
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = max(0, len(self._ids) - self.CONTEXT_TOKENS), len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (e.g. a truncated character)."""
        prefix, full = self._decode(self._read_offset), self._decode(len(self._ids))
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""

    def _decode(self, end: int) -> str:
        return self._tok.decode(self._ids[self._prefix_offset : end], self._skip)
