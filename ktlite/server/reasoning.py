"""Reasoning ("thinking") split from the answer, in the tag formats real models emit.

    reasoning, content = split_reasoning(parser, text, prompt_opens_think=False)
    s = reasoning_stream(parser, prompt_opens_think=False, tool_markers=())
    s.feed(delta) -> (reasoning_delta, content_delta); s.finish() -> (reasoning_delta, content_delta)
    prompt_opens_think(parser, rendered_prompt) -> bool

`parser` is one of `PARSERS` (SGLang's names). Reasoning is the text of a think block that opens at
the very start of the output (leading whitespace aside), or from the first token when the format
always starts inside one (`deepseek-r1`) or the rendered prompt already opened it
(`prompt_opens_think=True`). It ends at the closing tag, at a marker that starts a tool call (kept
in the content for the tool-call parser), or with the text (a truncated think block is all
reasoning). The call markers are the format's own (models that may start a call without closing the
block, as SGLang's detectors list them) and `tool_markers`, the active tool-call parser's region
markers: a call started inside an unclosed block is a call, never reasoning. Whitespace around the reasoning and at the
start of the content after a closing tag is dropped; text with no think block is content, verbatim.
An opening tag later in the text is content. Streamed pieces concatenate to `split_reasoning`'s
answer (`split_reasoning` is one `feed` plus `finish`); text that may be the start of a tag is held
back until decided. `gpt-oss` is not a think block but harmony's channels: see harmony.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ktlite.errors import ConfigError
from ktlite.server.harmony import HarmonyStream
from ktlite.server.split_stream import SplitStream
from ktlite.server.tool_parsers.markers import first_marker, partial_start


@dataclass(frozen=True)
class ThinkFormat:
    open: str
    close: str
    starts_inside: bool = False  # reasoning from the first token, with or without the opening tag
    interrupts: tuple[str, ...] = ()  # tool-call markers that end reasoning without the closing tag
    harmony: bool = False  # gpt-oss's channels (harmony.py): `open` starts an analysis body, `close` ends it


# gpt-oss: its analysis message's header opens the reasoning; closing it is ending that message and opening
# the final answer's (what a thinking budget forces)
_HARMONY = ThinkFormat("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>",
                       harmony=True)


_THINK = ("<think>", "</think>")
FORMATS: dict[str, ThinkFormat] = {
    "deepseek-r1": ThinkFormat(*_THINK, starts_inside=True),  # its template opens <think> in the prompt
    "deepseek-v3": ThinkFormat(*_THINK),
    "qwen3": ThinkFormat(*_THINK, interrupts=("<tool_call>",)),
    "kimi": ThinkFormat("\u25c1think\u25b7", "\u25c1/think\u25b7"),  # ◁think▷ ... ◁/think▷
    "kimi_k2": ThinkFormat(*_THINK, interrupts=("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")),
    "glm45": ThinkFormat(*_THINK, interrupts=("<tool_call>",)),
    "minimax": ThinkFormat(*_THINK),  # the template ends the prompt with "<think>\n"
    "gpt-oss": _HARMONY,
}
PARSERS: tuple[str, ...] = tuple(sorted(FORMATS))


def think_format(parser: str) -> ThinkFormat:
    try:
        return FORMATS[parser]
    except KeyError:
        raise ConfigError(f"unknown reasoning parser {parser!r}; supported: {', '.join(PARSERS)}") from None


def prompt_opens_think(parser: str, prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open think block (its last think tag opens one)."""
    fmt = think_format(parser)
    if fmt.harmony:  # earlier turns hold whole messages; only a prompt ending in an analysis header opens one
        return prompt_text.endswith(fmt.open)
    return prompt_text.rfind(fmt.open) > prompt_text.rfind(fmt.close)


def reasoning_stream(parser: str, prompt_opens_think: bool = False,
                     tool_markers: tuple[str, ...] = ()) -> ReasoningStream | HarmonyStream:
    """The parser's incremental split. Harmony marks a tool call by its recipient, whatever `tool_markers` say."""
    if think_format(parser).harmony:
        return HarmonyStream(prompt_opens_think)
    return ReasoningStream(parser, prompt_opens_think, tool_markers)


class ReasoningStream(SplitStream):
    """Incremental split: `feed(delta)` and `finish()` return (reasoning_delta, content_delta)."""

    def __init__(self, parser: str, prompt_opens_think: bool = False, tool_markers: tuple[str, ...] = ()):
        super().__init__()
        self._fmt = think_format(parser)
        self._ends = tuple(dict.fromkeys((self._fmt.close, *self._fmt.interrupts, *tool_markers)))
        self._inside = self._fmt.starts_inside or prompt_opens_think
        self._state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self._drop_space = False  # leading whitespace of the current part is not kept

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "start":
                if not self._start(final):
                    break
            elif self._state == "reasoning":
                if not self._reasoning(final, reasoning):
                    break
            else:
                content.append(self._take_leading(self._buf))
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def _start(self, final: bool) -> bool:
        """Decide whether the output opens with a think block; False while undecided."""
        head = self._buf.lstrip()
        if head.startswith(self._fmt.open):
            self._buf = head[len(self._fmt.open):]
            self._state, self._drop_space = "reasoning", True
            return True
        if not final and self._fmt.open.startswith(head):  # empty, or the opening tag still arriving
            return False
        self._state, self._drop_space = ("reasoning", True) if self._inside else ("content", False)
        return True

    def _reasoning(self, final: bool, out: list[str]) -> bool:
        """Pass reasoning through up to the block's end; True when the block ended."""
        at, marker = first_marker(self._buf, self._ends)
        hold = len(self._buf) if final else partial_start(self._buf, self._ends)
        if at < 0 or hold < at:
            # Trailing whitespace waits: it is dropped if the block ends right after it.
            text = self._take_leading(self._buf[:hold])
            body = text.rstrip()
            self._buf = ("" if final else text[len(body):]) + self._buf[hold:]
            out.append(body)
            return False
        out.append(self._take_leading(self._buf[:at]).rstrip())
        closed = marker == self._fmt.close
        self._buf = self._buf[at + len(marker):] if closed else self._buf[at:]
        self._state, self._drop_space = "content", closed
        return True

    def _take_leading(self, text: str) -> str:
        if self._drop_space:
            text = text.lstrip()
            self._drop_space = not text
        return text


def split_reasoning(parser: str, text: str, prompt_opens_think: bool = False) -> tuple[str, str]:
    """Whole model output -> (reasoning, content)."""
    stream = reasoning_stream(parser, prompt_opens_think)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return r1 + r2, c1 + c2
