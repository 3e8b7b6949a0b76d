"""Tokenizer, chat template and streaming detokenization for an HF model folder.

The chat template comes from `chat_template.jinja` (recent transformers) or `tokenizer_config.json`
(hub folders; a string or a list of named templates) and is rendered in a sandboxed jinja2
environment, as transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ktlite.errors import CheckpointError, RequestError

REPLACEMENT_CHAR = "\ufffd"


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


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
        if not path.is_file():
            raise CheckpointError(f"{path} not found: ktlite needs a fast-tokenizer tokenizer.json in the model folder")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        tok_config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(tok_config.get("bos_token"))
        self.eos_token = _token_text(tok_config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(tok_config.get("add_bos_token", self.bos_token_id is not None))
        self.eos_token_ids = self._eos_ids(model_dir)
        source = _load_chat_template(model_dir, tok_config)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
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

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        if self._chat_template is None:
            raise RequestError("this model has no chat template; use the completions API with a plain prompt", "messages")
        try:
            return self._chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise RequestError(f"chat template rejected the messages: {exc}", "messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        # the template writes the BOS token itself
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_bos=False)

    def detokenizer(self, prompt_ids: list[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids or [])


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas whose concatenation equals decode(all ids).

    Byte-level tokens can split one UTF-8 character; such a tail decodes to U+FFFD, so the delta is
    held back until the character completes. A few previous tokens are decoded along with the new
    ones because some decoders (e.g. sentencepiece spaces) depend on the left context.
    """

    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0  # start of the context window within _ids
        self._read_offset = len(self._ids)  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if full.endswith(REPLACEMENT_CHAR) or len(full) < len(prefix) or not full.startswith(prefix):
            return ""  # an incomplete character: wait for more bytes
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = max(0, len(self._ids) - self.CONTEXT_TOKENS), len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (e.g. a truncated character)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""
