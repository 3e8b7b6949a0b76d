"""Grammar-constrained sampling: JSON schemas -> per-request token masks (xgrammar).

Why xgrammar (bench/grammar_engines.py, 150k-token vocabulary, 2 busy cores): its token mask
stays under ~0.7 ms at every step (mean 0.2 ms on a schema with enums, a bounded integer, an array
and a 40-character string), where llguidance spent ~7-8 ms per token inside the length-bounded
string (mean 1.1 ms); both are ~0.1-0.5 ms on free-form JSON. llguidance compiles a schema in 1-5 ms
against xgrammar's 3-500 ms, so compiles here are cached per schema and run off the event loop
(`compile` in a worker thread) before a request is queued; set-up is ~1-3 s against ~4-5 s.

Output is compact JSON: no whitespace between tokens (`any_whitespace=False`, separators `,` `:`),
so a model cannot spend its tokens on blanks. Objects accept only the properties their schema
names (xgrammar's strict mode) unless the schema says otherwise with `additionalProperties`.

A request's `GrammarState` starts at the beginning of its output and advances by each token the
scheduler keeps, so preemption (which keeps the output and recomputes its KV) leaves it valid; a
finished or aborted request drops it. When the grammar is complete it allows only the EOS tokens,
and accepting one terminates it (the scheduler then finishes the request with "stop").
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from ktlite.errors import RequestError
from ktlite.runtime.tokenizer import Tokenizer

COMPILE_CACHE_BYTES = 256 * 2**20  # compiled grammars kept for reuse (tool schemas repeat across turns)
_SOURCE_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


def _vocab_type(spec: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """(how token strings encode bytes, whether the tokenizer prepends a space) from tokenizer.json."""
    decoder = spec.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        kind = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in kinds:
        kind = xgr.VocabType.BYTE_FALLBACK
    else:
        kind = xgr.VocabType.RAW
    normalizer = spec.get("normalizer") or {}
    pre = spec.get("pre_tokenizer") or {}
    parts = [normalizer, *(normalizer.get("normalizers") or []), pre, *(pre.get("pretokenizers") or [])]
    prefix_space = any(p.get("type") == "Prepend" or (p.get("type") == "Metaspace" and p.get("prepend_scheme",
                       "always" if p.get("add_prefix_space", True) else "never") != "never") for p in parts)
    return kind, prefix_space


class GrammarBackend:
    """One per engine: the tokenizer's vocabulary for xgrammar and a cache of compiled schemas."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.vocab_size = vocab_size  # the logits' width (the model may pad past the tokenizer)
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._batch = xgr.BatchGrammarMatcher(max_threads=min(4, os.cpu_count() or 1))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:  # built on first use: ~1-3 s for a 150k vocabulary
            if self._compiler is None:
                spec = json.loads(self._tokenizer.backend_json)
                kind, prefix_space = _vocab_type(spec)
                special = self._tokenizer.special_token_ids
                # special tokens are "" so no grammar ever allows them (EOS is added back as the stop token)
                vocab = ["" if i in special else (self._tokenizer.id_to_token(i) or "")
                         for i in range(min(self.vocab_size, self._tokenizer.vocab_size))]
                info = xgr.TokenizerInfo(vocab, kind, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self._tokenizer.eos_token_ids),
                                         add_prefix_space=prefix_space)
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(2, os.cpu_count() or 1),
                                                     cache_limit_bytes=COMPILE_CACHE_BYTES)
            return self._compiler

    def compile(self, schema: str) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache) a canonical schema; RequestError when xgrammar rejects it.
        Takes milliseconds to a second on a new schema: call it off the event loop."""
        compiler = self._get_compiler()
        try:
            return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"), strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _SOURCE_PREFIX.sub("", str(exc)).strip()  # "[time] file.cc:line: " says nothing to a client
            raise RequestError(f"the JSON schema cannot be enforced: {reason}"[:1000], "json_schema") from exc

    def state(self, schema: str) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self.compile(schema)))

    def masks(self, states: list[GrammarState], rows: list[int], batch: int) -> TokenMasks:
        """The next-token masks of `states` for rows `rows` of a batch of `batch` logits rows."""
        bits = xgr.allocate_token_bitmask(batch, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bits, rows)
        return TokenMasks(bits, rows)


@dataclass
class TokenMasks:
    """Allowed next tokens of some rows of a logits batch: int32 bits [batch, ceil(V/32)] (token t is
    bit t % 32 of word t // 32), filled for `rows` only."""

    bits: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """In place: logits[r, t] = -inf for every r in rows and t its mask does not allow."""
        xgr.apply_token_bitmask_inplace(logits, self.bits.to(logits.device, non_blocking=True), indices=self.rows)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> bool:
        """Accept the sampled token; False if the grammar does not allow it (then the state is unchanged)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The output is complete and a stop token was accepted."""
        return self.matcher.is_terminated()
