"""The shape of the reasoning splitters (reasoning.py's think blocks, harmony.py's channels): text fed in deltas,
(reasoning_delta, content_delta) out, the undecided rest kept in `_buf` until more text or `finish` decides it."""

from __future__ import annotations


class SplitStream:
    def __init__(self) -> None:
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        raise NotImplementedError
