"""Tokenizers shipped as `tiktoken.model` instead of tokenizer.json.

The folder holds the BPE ranks (`tiktoken.model`: base64 token, space, rank per line) and
`tokenizer_config.json`, whose `added_tokens_decoder` names the special tokens; transformers loads it
through the checkpoint's own Python class (trust_remote_code), which ktlite does not run. What that class
does, and this module does with the `tiktoken` package:
- ids 0..n-1 are the ranks; the next NUM_RESERVED_SPECIAL ids are special tokens, named by
  added_tokens_decoder or `<|reserved_token_{id}|>`;
- the pre-tokenization regex is `pat_str` from tokenizer_config.json when given, else DEFAULT_PATTERN;
- special tokens written in the text (as a chat template writes them) encode to their ids.

`TiktokenBackend` offers the part of `tokenizers.Tokenizer`'s interface ktlite's Tokenizer uses, so the
chat template, streaming detokenization and grammar masks work unchanged. Token strings (`id_to_token`)
use GPT-2's byte-to-unicode alphabet, the byte-level convention the grammar engines read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktlite.errors import CheckpointError

TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL = 256  # such tokenizers reserve this many ids after the BPE ranks
DEFAULT_PATTERN = "|".join([  # the split regex the tiktoken.model checkpoints' own tokenizer class hard-codes
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (tokenizers' ByteLevel)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


@dataclass(frozen=True)
class _Added:
    content: str
    special: bool = True


@dataclass(frozen=True)
class _Encoding:
    ids: list[int]


class TiktokenBackend:
    def __init__(self, model_dir: Path, tok_config: dict[str, Any]):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as exc:
            raise CheckpointError(f"{model_dir} has a {TIKTOKEN_FILE} tokenizer: pip install tiktoken") from exc
        ranks = load_tiktoken_bpe(str(model_dir / TIKTOKEN_FILE))
        n = len(ranks)
        named = {int(i): str(t.get("content") if isinstance(t, dict) else t)
                 for i, t in (tok_config.get("added_tokens_decoder") or {}).items()}
        last = max([n + NUM_RESERVED_SPECIAL - 1, *named])
        self._special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, last + 1)}
        self._special_by_id = {i: t for t, i in self._special.items()}
        self._enc = tiktoken.Encoding(name=model_dir.name, pat_str=tok_config.get("pat_str") or DEFAULT_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self._special)
        self._alphabet = _byte_alphabet()

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        return _Encoding(self._enc.encode(text, allowed_special="all"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_by_id]
        return self._enc.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        if token in self._special:
            return self._special[token]
        try:
            return self._enc.encode_single_token(token.encode())
        except KeyError:
            return None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        try:
            raw = self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return None
        return "".join(self._alphabet[b] for b in raw)

    def get_vocab_size(self) -> int:
        return self._enc.n_vocab

    def get_added_tokens_decoder(self) -> dict[int, _Added]:
        return {i: _Added(t) for i, t in self._special_by_id.items()}

    def to_str(self) -> str:
        """What grammar engines read of a tokenizer.json: byte-level token strings."""
        return json.dumps({"model": {"type": "BPE"}, "decoder": {"type": "ByteLevel"}})
