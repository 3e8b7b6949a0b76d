"""When a request finishes: ending token ids and max_tokens, and streaming-safe stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from ktlite.runtime.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort"]  # "abort" is set by the scheduler itself


def finish_reason(
    params: SamplingParams, token_id: int, num_output_tokens: int, eos_token_ids: Iterable[int]
) -> FinishReason | None:
    """Call after each new token; num_output_tokens counts it.

    "stop" when it is a stop_token_id or EOS (unless ignore_eos) and min_tokens is already met,
    "length" when max_tokens is reached, else None. "stop" wins when both hold: the model ended.
    """
    if num_output_tokens > params.min_tokens and token_id in params.ending_token_ids(eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


class StopStringMatcher:
    """Cuts a stream of text deltas before the first occurrence of any stop string.

    Text that could still become the start of a stop string is held back, so nothing emitted
    is ever retracted: the concatenation of everything `feed` and `flush` return is the full text
    cut before the earliest stop occurrence (or the full text if there is none).
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")  # SamplingParams.validate rejects these first
        self._stops = list(stops)
        self._longest = max(map(len, self._stops), default=0)
        self._pending = ""  # held back: a suffix that is a proper prefix of some stop string
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            # Everything before `text` was emitted only because no stop could start there, so the
            # earliest hit lies in `text`.
            self._pending, self.stopped = "", True
            return text[: min(hits)], True
        keep = self._held_suffix_len(text)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of a stream that finished for another reason: the held-back text."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
