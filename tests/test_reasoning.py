"""Reasoning parsers: whole and streamed under many random chunkings give the same (reasoning,
content), for think blocks the model opens, think blocks the prompt opened, truncated thinking,
no thinking, and a tool call that ends thinking without the closing tag."""

from __future__ import annotations

import random

import pytest

from ktlite.server.reasoning import (PARSERS, ReasoningStream, prompt_opens_think, reasoning_stream, split_reasoning,
                                     think_format)

# the think-tag formats (gpt-oss's harmony channels: test_harmony.py)
THINK_PARSERS = tuple(p for p in PARSERS if not think_format(p).harmony)
TAGS = {p: ("<think>", "</think>") for p in THINK_PARSERS} | {"kimi": ("◁think▷", "◁/think▷")}
ALWAYS_INSIDE = {"deepseek-r1"}  # R1 reasons from the first token whatever the prompt says


def chunkings(text: str, seed: int, count: int = 40) -> list[list[str]]:
    rng = random.Random(seed)
    out = [list(text), [text]]
    for _ in range(count):
        pieces, i = [], 0
        while i < len(text):
            n = rng.choice((1, 1, 2, 3, 5, 8))
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def check_everywhere(parser: str, text: str, expected: tuple[str, str], opened: bool = False, seed: int = 0):
    assert split_reasoning(parser, text, prompt_opens_think=opened) == expected
    for pieces in chunkings(text, seed):
        stream = reasoning_stream(parser, prompt_opens_think=opened)
        parts = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, pieces


def cases(parser: str) -> list[tuple[str, bool, tuple[str, str]]]:
    """(output, prompt_opens_think, (reasoning, content)) as the parser's models write them."""
    o, c = TAGS[parser]
    inside = parser in ALWAYS_INSIDE
    plain = "The answer is 42. Note: 3 < 5 and <b>bold</b>."
    return [
        (f"{o}\nLet me add 40 and 2.\nThat is 42.\n{c}\n\n{plain}", False,
         ("Let me add 40 and 2.\nThat is 42.", plain)),
        (f"Let me add 40 and 2.\n{c}\n\n{plain}", True, ("Let me add 40 and 2.", plain)),  # prompt opened it
        (f"\n{o}\nStill thinking about <b> and {o[:-1]}", False, (f"Still thinking about <b> and {o[:-1]}", "")),
        (f"{o}{c}{plain}", False, ("", plain)),  # empty think block
        (f"{o}\n\n{c}\n\n", True, ("", "")),
        (plain, True, (plain, "")),  # prompt opened it, truncated before the closing tag
        (plain, False, (plain, "") if inside else ("", plain)),  # no thinking at all
        (f"\n\n{plain}", False, (plain, "") if inside else ("", f"\n\n{plain}")),  # verbatim when no think block
        (f"{plain} {o}not reasoning{c}", False, (f"{plain} {o}not reasoning", "") if inside
         else ("", f"{plain} {o}not reasoning{c}")),  # a tag mid-answer is the answer's text
        (f"{o}a{c}b{c}c", False, ("a", f"b{c}c")),
        ("", False, ("", "")),
        (o[:3], False, (o[:3], "") if inside else ("", o[:3])),
    ]


@pytest.mark.parametrize("parser", THINK_PARSERS)
def test_split_and_stream_agree(parser):
    for i, (text, opened, expected) in enumerate(cases(parser)):
        check_everywhere(parser, text, expected, opened, seed=i)


@pytest.mark.parametrize("parser, marker", [("qwen3", "<tool_call>"), ("kimi_k2", "<|tool_calls_section_begin|>"),
                                            ("kimi_k2", "<|tool_call_section_begin|>")])
def test_tool_call_ends_reasoning(parser, marker):
    call = f"{marker}\n<function=f>\n</function>\n"
    check_everywhere(parser, f"<think>\nI should call f.\n{call}", ("I should call f.", call))
    check_everywhere(parser, f"I should call f. {call}", ("I should call f.", call), opened=True)


def test_stream_holds_back_a_possible_tag():
    stream = ReasoningStream("qwen3", prompt_opens_think=True)
    assert stream.feed("Thinking <") == ("Thinking", "")  # "<" may start </think>; the space may end reasoning
    assert stream.feed("b>") == (" <b>", "")
    assert stream.feed(" done.\n</th") == (" done.", "")
    assert stream.feed("ink>\n\nAnswer") == ("", "Answer")
    assert stream.finish() == ("", "")


@pytest.mark.parametrize("parser, prompt, expected", [
    ("deepseek-r1", "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n", True),
    ("deepseek-v3", "<｜User｜>hi<｜Assistant｜></think>", False),  # V3.1 non-thinking mode
    ("deepseek-v3", "<｜User｜>hi<｜Assistant｜>ok<｜end▁of▁sentence｜><｜User｜>more<｜Assistant｜><think>", True),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    ("minimax", "]~b]user\nhi[e~[\n]~b]ai\n<think>\n", True),
    ("glm45", "[gMASK]<sop><|user|>hi<|assistant|></think>", False),
    ("glm45", "[gMASK]<sop><|user|>hi<|assistant|><think>", True),
    ("kimi", "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>◁think▷", True),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|><think>old</think>done<|im_end|><|im_assistant|>", False),
])
def test_prompt_opens_think(parser, prompt, expected):
    assert prompt_opens_think(parser, prompt) is expected


def test_unknown_parser_names_the_supported_ones():
    with pytest.raises(ValueError) as err:
        split_reasoning("deepseek", "x")
    assert all(name in str(err.value) for name in PARSERS)


def test_reasoning_then_tool_calls_in_one_stream():
    """The order the server applies them: reasoning split first, its content deltas into the tool parser."""
    from ktlite.server.tool_parsers import ToolCallStream

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}}}}}]
    text = "<think>\nCall f.\n<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    for pieces in chunkings(text, seed=7):
        reasoning_stream, tool_stream = ReasoningStream("qwen3"), ToolCallStream("qwen3_coder", tools)
        reasoning, content = "", ""
        for piece in [*pieces, None]:
            r, c = reasoning_stream.feed(piece) if piece is not None else reasoning_stream.finish()
            c, _ = tool_stream.feed(c)
            reasoning, content = reasoning + r, content + c
        content += tool_stream.finish()[0]
        assert (reasoning, content, tool_stream.calls) == ("Call f.", "", [{"name": "f", "arguments": {"n": 7}}])
