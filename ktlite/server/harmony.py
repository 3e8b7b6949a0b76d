"""gpt-oss's harmony messages in model output -> reasoning and content (`--reasoning-parser gpt-oss`).

The output after the prompt's `<|start|>assistant` is a run of messages (OpenAI's harmony response format):

    [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>

ended by `<|end|>`, by the stop tokens `<|call|>` (a tool call) and `<|return|>` (the answer is done), or where
the next message's header starts. The recipient may also follow the role (`<|start|>assistant to=functions.f
<|channel|>commentary ...`; in the output's first message the role is the prompt's, so it opens with ` to=`).
Routing:
- `analysis` bodies (chain of thought) are reasoning;
- `final` bodies (the answer) and `commentary` bodies without a recipient (preambles shown to the user) are
  content;
- a message with a recipient (a tool call) passes to the content verbatim, header and terminator included
  (the first message's role restored as `<|start|>assistant`), for the tool-call parser
  (`--tool-call-parser gpt-oss`) to take apart;
- text outside any message is content, whitespace between messages is dropped.
Two bodies of the same kind (reasoning, or content) are joined by a blank line. A message still open at the
end keeps what it had (a truncated chain of thought is reasoning); a header still open at the end is dropped.
Streamed pieces concatenate to the whole text's answer: a tail that may be the start of a marker is held back.
"""

from __future__ import annotations

import re

from ktlite.server.split_stream import SplitStream
from ktlite.server.tool_parsers.markers import first_marker, partial_start

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_HEADS = (START, CHANNEL)
ROLE = START + "assistant"
_BODY_ENDS = (*TERMINATORS, *_HEADS)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=")
SEPARATOR = "\n\n"


class HarmonyStream(SplitStream):
    """Incremental split: `feed(delta)` and `finish()` return (reasoning_delta, content_delta)."""

    def __init__(self, opens_analysis: bool = False):
        super().__init__()
        # the prompt may end inside an analysis message's body (`<|channel|>analysis<|message|>`)
        self._state = "body" if opens_analysis else "between"  # "between" -> "header" -> "body" -> ...
        self._route = "reasoning"  # the open body's destination: "reasoning", "content" or "raw" (a call)
        self._started = {"reasoning": False, "content": False}  # a body of that kind was emitted
        self._first = not opens_analysis  # the first message's header may open with its recipient (` to=`)
        self._in_text = False  # inside text outside any message
        self._after_message = opens_analysis
        self._space = ""  # whitespace after that text (or before it), not yet known to be content

    def _run(self, final: bool) -> tuple[str, str]:
        out = {"reasoning": [], "content": []}
        step = {"between": self._between, "header": self._header, "body": self._body}
        while step[self._state](final, out):
            pass
        return "".join(out["reasoning"]), "".join(out["content"])

    def _between(self, final: bool, out: dict[str, list[str]]) -> bool:
        """Text up to the next message header is content; True when a header starts."""
        if self._first:
            head = self._buf.lstrip()
            if not final and "to=".startswith(head):
                return False  # empty, or ` to=` still arriving
            self._first = False
            if head.startswith("to="):
                self._state = "header"
                return True
        at, _ = first_marker(self._buf, _HEADS)
        hold = len(self._buf) if final else partial_start(self._buf, _HEADS)
        cut = hold if at < 0 or hold < at else at
        self._free_text(self._buf[:cut], out)
        self._buf = self._buf[cut:]
        if cut == at:
            self._state, self._space, self._in_text, self._after_message = "header", "", False, True
            return True
        if final and self._in_text:
            out["content"].append(self._space)  # the text's own trailing whitespace
        return False

    def _free_text(self, text: str, out: dict[str, list[str]]) -> None:
        """Text outside messages, verbatim but for whitespace next to a message; trailing whitespace waits for
        what follows (more text, or a header that drops it)."""
        body = text.rstrip()
        if not body:
            self._space += text
            return
        lead = self._space
        if not self._in_text:
            if self._after_message:
                lead, body = "", body.lstrip()
            self._open("content", out)
            self._in_text = True
        out["content"].append(lead + body)
        self._space = text[len(text.rstrip()):]

    def _header(self, final: bool, out: dict[str, list[str]]) -> bool:
        end = self._buf.find(MESSAGE)
        if end < 0:
            if final:
                self._buf = ""  # cut off inside a header: nothing of the message was said
            return False
        header = self._buf[:end + len(MESSAGE)]
        channel = _CHANNEL_NAME.search(header)
        if _RECIPIENT.search(header):
            self._route = "raw"
            out["content"].append(header if header.startswith(_HEADS) else ROLE + header)
        else:
            self._route = "reasoning" if channel is not None and channel[1] == "analysis" else "content"
            self._open(self._route, out)
        self._buf, self._state = self._buf[len(header):], "body"
        return True

    def _body(self, final: bool, out: dict[str, list[str]]) -> bool:
        at, marker = first_marker(self._buf, _BODY_ENDS)
        hold = len(self._buf) if final else partial_start(self._buf, _BODY_ENDS)
        cut = hold if at < 0 or hold < at else at
        target = out["content" if self._route == "raw" else self._route]
        target.append(self._buf[:cut])
        if cut != at:
            self._buf = self._buf[cut:]
            return False
        ended = marker in TERMINATORS  # else the next header starts: it stays for `_between`
        if self._route == "raw" and ended:
            target.append(marker)
        self._buf, self._state = self._buf[at + len(marker) if ended else at:], "between"
        return True

    def _open(self, kind: str, out: dict[str, list[str]]) -> None:
        """A new body of `kind` starts: a blank line after the previous one."""
        if self._started[kind]:
            out[kind].append(SEPARATOR)
        self._started[kind] = True
