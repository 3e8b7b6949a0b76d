"""Server-sent events: OpenAI's `data: {json}\n\n` frames ending in `data: [DONE]`, and Anthropic's
named events (`event: NAME\ndata: {json}\n\n`, no terminator)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


def frame(obj: dict[str, Any] | str, event: str | None = None) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


DONE = frame("[DONE]")


class ClientGone(Exception):
    """The client closed the connection; the request is to be aborted."""


class SSEWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.started = False

    async def start(self) -> None:
        await self.response.prepare(self.request)
        self.started = True

    async def send(self, obj: dict[str, Any] | str, event: str | None = None) -> None:
        await self._write(frame(obj, event))

    async def done(self) -> None:
        """OpenAI's end of stream: `data: [DONE]`."""
        await self._write(DONE)
        await self.end()

    async def end(self) -> None:
        await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:  # aiohttp: ClientConnectionResetError, "closing transport"
            raise ClientGone() from exc
