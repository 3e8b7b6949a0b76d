"""OpenAI's logprobs objects from the engine's `TokenLogprob`s.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}, ...]}`.
Legacy completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, where each top_logprobs
entry maps token text -> logprob for the top alternatives and the chosen token (so up to k + 1
entries, as OpenAI documents; ids that decode to the same text share an entry, holding the
likeliest one's value, so its maximum stays the top logprob); with echo the prompt tokens come first, the first with null values.
A token's text is the tokenizer's decoding of that id alone (special tokens included), its bytes
that text's UTF-8; text_offset counts characters of those texts into the choice's text.
"""

from __future__ import annotations

from typing import Any

from ktlite.runtime.logprobs import TokenLogprob


class LogprobShapes:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._texts[token_id]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat(self, lps: list[TokenLogprob], top: int) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top[:top]]} for lp in lps],
                "refusal": None}

    def completion(self, lps: list[TokenLogprob], top: int, first: int | None = None,
                   offset: int = 0) -> dict[str, Any]:
        """`first`: the echoed prompt's first token (it has no logprob), None without echo; `offset`:
        where the first token's text starts in the choice's text."""
        tokens, values, tops, offsets = [], [], [], []
        if first is not None:
            tokens, values, tops, offsets = [self.text(first)], [None], [None], [offset]
            offset += len(tokens[0])
        for lp in lps:
            text = self.text(lp.token_id)
            alternatives: dict[str, float] = {}
            for t, v in [*lp.top[:top], (lp.token_id, lp.logprob)]:
                alternatives.setdefault(self.text(t), v)  # ids with the same text: the likeliest's value
            tokens.append(text)
            values.append(lp.logprob)
            tops.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
