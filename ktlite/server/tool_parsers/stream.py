"""The scanner: model text in (whole or in deltas) -> content and OpenAI tool calls out.

`parse_tool_calls` is one `feed` of the whole text plus `finish`, so the streaming and the
non-streaming answers are the same by construction; every decision below depends only on text
already seen *and* complete (a marker fully present, a call closed, or the end of the stream),
never on where the deltas happened to be cut.

Rules:
- Content is the text outside call regions, its whitespace as written (SGLang's MiniMax-M2 detector
  joins the text around each call block verbatim): "Checking now.\n\n<call region>I will ..." gives
  "Checking now.\n\nI will ...". Whitespace between a region and the content's start or end, or
  between two regions, is not content: "Let me check.\n\n<tool_call>..." gives "Let me check.".
  It is passed through as it arrives, except a tail that could still be the start of a region
  marker, and trailing whitespace (held until the next non-space text shows which of those it is).
- A call is emitted whole once its closing marker arrives: a first delta with id, type and name
  (arguments ""), then one delta with all its arguments as `dump_arguments(arguments)`.
- Malformed text (unknown function, bad JSON, anything but whitespace between calls, a call still
  open at the end) falls back to content verbatim from where the broken call starts (from the
  region's opening marker when it is the region's first call: then there was no region);
  scanning resumes right there, so a later well-formed region is still parsed.
- A region whose calls are complete but whose closing marker never came (the model stopped at EOS)
  is accepted.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ktlite.errors import ConfigError
from ktlite.server.tool_parsers.formats import FORMATS, ToolFormat
from ktlite.server.tool_parsers.markers import first_marker, partial_start
from ktlite.server.tool_parsers.values import tool_schemas

ToolCall = dict[str, Any]  # {"name": str, "arguments": dict}
CallDelta = dict[str, Any]  # OpenAI `choices[].delta.tool_calls[]` item


def dump_arguments(arguments: dict[str, Any]) -> str:
    """The one serialization of a call's arguments, streamed and non-streamed alike."""
    return json.dumps(arguments, ensure_ascii=False)


def tool_format(parser: str) -> ToolFormat:
    try:
        return FORMATS[parser]
    except KeyError:
        raise ConfigError(f"unknown tool-call parser {parser!r}; supported: {', '.join(sorted(FORMATS))}") from None


class ToolCallStream:
    """Incremental tool-call parser: `feed(delta)` and `finish()` return (content_delta, call_deltas)."""

    def __init__(self, parser: str, tools: list[dict[str, Any]] | None):
        self._fmt = tool_format(parser)
        self._schemas = tool_schemas(tools)
        self.calls: list[ToolCall] = []  # every call emitted so far, arguments parsed
        self._buf = ""  # undecided text: content tail outside a region, the unparsed rest inside one
        self._in_region = False
        self._region_calls = 0
        self._fallback = ""  # the region's opening marker, content if the region's first call is malformed
        # Whitespace outside regions waits until the next text decides it (the rules above).
        self._held = ""  # since the last text (after a region: since the last region)
        self._gap_head = ""  # between the last text and the regions that followed it
        self._after_region = False  # a region came since the last text
        self._text_seen = False
        # While a call's closing marker is awaited, deltas are only collected (not joined, not
        # searched) until the marker can be complete: long arguments stay linear in their length.
        self._awaited = ""
        self._parts: list[str] = []
        self._tail = ""  # the last len(_awaited) - 1 characters received

    @property
    def region_starts(self) -> tuple[str, ...]:
        """The markers that open a call region (a reasoning split ends an unclosed think block at them)."""
        return self._fmt.starts

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self._parts.append(delta)
        if self._awaited:
            window = self._tail + delta
            if self._awaited not in window:
                self._tail = window[max(0, len(window) - len(self._awaited) + 1):]
                return "", []
        return self._run(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[CallDelta]]:
        self._buf += "".join(self._parts)
        self._parts.clear()
        self._awaited = ""
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self._region_step(final, content, deltas) if self._in_region else self._content_step(final, content):
            pass
        if final and not self._after_region:  # trailing whitespace of the text itself
            content.append(self._held)
        return "".join(content), deltas

    def _content_step(self, final: bool, out: list[str]) -> bool:
        """Pass content through up to the next region marker; True when a region was entered."""
        starts = self._fmt.starts
        at, marker = first_marker(self._buf, starts)
        hold = len(self._buf) if final else partial_start(self._buf, starts)
        if at < 0 or hold < at:
            self._text(self._buf[:hold], out)
            self._buf = self._buf[hold:]
            return False
        self._text(self._buf[:at], out)
        self._fallback = marker
        self._buf = self._buf[at + len(marker):]
        self._in_region, self._region_calls = True, 0
        return True

    def _text(self, text: str, out: list[str]) -> None:
        """Content outside regions: emitted up to its trailing whitespace, which is held."""
        body = text.strip()
        if not body:
            self._held += text
            return
        space = self._held + text[:text.index(body[0])]
        if self._after_region:  # kept only between two texts
            space = self._gap_head + space if self._text_seen else ""
        out.append(space + body)
        self._held = text[len(text.rstrip()):]
        self._gap_head, self._after_region, self._text_seen = "", False, True

    def _region_found(self) -> None:
        """The region is one (a call in it parsed, or it closed empty): the whitespace before it is a gap."""
        if not self._after_region:
            self._gap_head, self._after_region = self._held, True
        self._held = ""  # whitespace between two regions is not content

    def _region_step(self, final: bool, out: list[str], deltas: list[CallDelta]) -> bool:
        """Consume one call or the region's end; False when more text is needed."""
        fmt, buf = self._fmt, self._buf
        pos = len(buf) - len(buf.lstrip())
        rest = buf[pos:]
        if not rest:
            if final and self._region_calls:
                self._close_region(len(buf))  # calls complete, closing marker never came
            elif final:
                self._give_back(pos, out)
                return True
            return False
        end = next((e for e in fmt.ends if rest.startswith(e)), None)
        if end is not None:
            self._close_region(pos + len(end))
            return True
        if rest.startswith(fmt.call_open):
            body_at = pos + len(fmt.call_open)
            close_at = buf.find(fmt.call_close, body_at)
            if close_at < 0:
                if final:
                    self._give_back(pos, out)
                else:
                    self._awaited, self._tail = fmt.call_close, buf[max(0, len(buf) - len(fmt.call_close) + 1):]
                return final
            parsed = fmt.parse_call(buf[body_at:close_at], self._schemas)
            if parsed is None or parsed[0] not in self._schemas:
                self._give_back(pos, out)
                return True
            if not self._region_calls:
                self._region_found()
            self._emit(*parsed, deltas)
            self._buf = buf[close_at + len(fmt.call_close):]
            self._region_calls += 1
            self._fallback = ""
            if not fmt.ends:
                self._close_region(0)
            return True
        if not final and any(m.startswith(rest) for m in (*fmt.ends, fmt.call_open)):
            return False  # a marker still arriving
        self._give_back(pos, out)
        return True

    def _close_region(self, consumed: int) -> None:
        if not self._region_calls:
            self._region_found()
        self._buf = self._buf[consumed:]
        self._in_region = False

    def _give_back(self, pos: int, out: list[str]) -> None:
        """Malformed: what was held since the last good call is content; scan on from `pos` as content."""
        self._text(self._fallback + self._buf[:pos], out)
        self._fallback, self._buf = "", self._buf[pos:]
        self._in_region = False

    def _emit(self, name: str, arguments: dict[str, Any], deltas: list[CallDelta]) -> None:
        index = len(self.calls)
        self.calls.append({"name": name, "arguments": arguments})
        deltas.append({"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": name, "arguments": ""}})
        deltas.append({"index": index, "function": {"arguments": dump_arguments(arguments)}})


def parse_tool_calls(parser: str, text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """Whole model output -> (content, [{"name", "arguments": dict}]); malformed calls stay content."""
    stream = ToolCallStream(parser, tools)
    head, _ = stream.feed(text)
    tail, _ = stream.finish()
    return head + tail, stream.calls
