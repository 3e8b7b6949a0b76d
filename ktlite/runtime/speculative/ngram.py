"""NGRAM drafts (prompt lookup): an output that copies its input (file contents, diffs) continues as it did before.

The sequence's last n tokens (n from MAX_MATCH down to MIN_MATCH) are looked up among its earlier n-grams; the
tokens that followed the most recent earlier occurrence are the drafts. The index of n-grams grows with the
sequence (O(MAX_MATCH) per token), so a step never rescans a long prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_MATCH = 4  # longest suffix matched (a longer match predicts better; tried first)
MIN_MATCH = 1  # shortest suffix matched


class NgramDrafter:
    def __init__(self, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH):
        self.max_match, self.min_match = max_match, min_match
        self.tokens: list[int] = []
        # n-gram -> position of the token that followed its latest occurrence (n-grams of every length, one dict)
        self._follower: dict[tuple[int, ...], int] = {}

    @property
    def seen(self) -> int:
        return len(self.tokens)

    def propose(self, new_tokens: Sequence[int], k: int) -> list[int]:
        for token in new_tokens:
            self._index_before(len(self.tokens))  # the n-grams that end where this token follows them
            self.tokens.append(int(token))
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_match, end - 1), self.min_match - 1, -1):
            start = self._follower.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self._continue(start, k)
        return []

    def _index_before(self, pos: int) -> None:
        for n in range(self.min_match, min(self.max_match, pos) + 1):
            self._follower[tuple(self.tokens[pos - n:pos])] = pos

    def _continue(self, start: int, k: int) -> list[int]:
        """The k tokens from `start` on; past the sequence's end the drafts repeat themselves (the match says the
        sequence is periodic with period end - start)."""
        end, drafts = len(self.tokens), []
        for i in range(k):
            pos = start + i
            drafts.append(self.tokens[pos] if pos < end else drafts[pos - end])
        return drafts
