"""Finding markers in streamed text: complete ones, and a tail that may be one still arriving."""

from __future__ import annotations


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Earliest complete marker in text: (index, marker), or (-1, "")."""
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else (-1, "")


def partial_start(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest suffix of text that is a proper prefix of some marker begins (len(text) if none).

    That tail must be held back from a stream until the next delta decides whether it is a marker."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return len(text) - k
    return len(text)
