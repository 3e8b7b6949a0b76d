"""Tool-call parsers: every format, whole and streamed under many random chunkings, give the same
content and calls; streamed argument fragments concatenate to json.dumps of the parsed arguments;
malformed call text falls back to content.

Model outputs are rendered here the way each model's chat template renders an assistant tool call
(the templates are the models' ground truth), plus byte-exact literal samples per format."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from ktlite.server import reasoning
from ktlite.server.chat_output import OutputPlan, OutputStream, parse_output
from ktlite.server.tool_parsers import PARSERS, ToolCallStream, dump_arguments, parse_tool_calls

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
            "zip": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "run_job", "description": "Run a job",
        "parameters": {"type": "object", "properties": {
            "ratio": {"type": "number"}, "opts": {"type": "object"},
            "items": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "mode": {"enum": ["fast", "slow"]}}}}},
]

Call = tuple[str, dict[str, Any]]
SCENARIOS: dict[str, tuple[str, list[Call]]] = {
    "one_call": ("", [("get_weather", {"city": "Paris", "days": 3})]),
    "two_calls": ("", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京", "zip": "02139"})]),
    "text_before": ("Let me check the weather for you.", [("get_weather", {"city": "Oslo"})]),
    "typed_nested": ("Running it.", [
        ("run_job", {"ratio": 0.25, "opts": {"retries": 2, "tags": {"a": [1, 2.5, None]}, "dry": True},
                     "items": ["x", "y z"], "note": "line one\nline two", "limit": 10, "mode": "fast"}),
        ("get_weather", {"city": "Boston", "days": 7, "celsius": False, "zip": "02139"})]),
    "no_arguments": ("", [("run_job", {})]),
    "no_call": ("The weather in Paris is sunny; 3 < 5 and a <b>tag</b> is fine.", []),
}


def _text(value: Any, scalar: Callable[[Any], str] = lambda v: json.dumps(v, ensure_ascii=False)) -> str:
    """A value as XML-style templates write it: strings raw, the rest JSON (or `scalar` for non-containers)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else scalar(value)


def _qwen3_coder(content: str, calls: list[Call]) -> str:
    # Qwen3-Coder's template: scalars through jinja's |string (True, None), containers through tojson.
    blocks = ["<tool_call>\n<function=" + name + ">\n"
              + "".join(f"<parameter={k}>\n{_text(v, str)}\n</parameter>\n" for k, v in args.items())
              + "</function>\n</tool_call>" for name, args in calls]
    return content + ("\n\n" if content and calls else "") + "\n".join(blocks)


def _glm45(content: str, calls: list[Call]) -> str:
    return content + "".join("\n<tool_call>" + name + "\n"
                             + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_text(v)}</arg_value>\n"
                                       for k, v in args.items()) + "</tool_call>" for name, args in calls)


def _glm47(content: str, calls: list[Call]) -> str:
    return content + "".join("<tool_call>" + name
                             + "".join(f"<arg_key>{k}</arg_key><arg_value>{_text(v)}</arg_value>"
                                       for k, v in args.items()) + "</tool_call>" for name, args in calls)


def _minimax_m2(content: str, calls: list[Call]) -> str:
    if not calls:
        return content
    return content + "\n<minimax:tool_call>\n" + "".join(
        f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{_text(v)}</parameter>\n'
                                                for k, v in args.items()) + "</invoke>\n"
        for name, args in calls) + "</minimax:tool_call>"


def _deepseekv32(content: str, calls: list[Call]) -> str:
    if not calls:
        return content
    invokes = [f'<｜DSML｜invoke name="{name}">\n' + "\n".join(
        f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">{_text(v)}'
        "</｜DSML｜parameter>" for k, v in args.items()) + "\n</｜DSML｜invoke>" for name, args in calls]
    return content + "\n\n<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


def _deepseekv3(content: str, calls: list[Call]) -> str:
    if not calls:
        return content
    return content + "<｜tool▁calls▁begin｜>" + "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```"
        "<｜tool▁call▁end｜>" for name, args in calls) + "<｜tool▁calls▁end｜>"


def _deepseekv31(content: str, calls: list[Call]) -> str:
    if not calls:
        return content
    return content + "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args, ensure_ascii=False)}<｜tool▁call▁end｜>"
        for name, args in calls) + "<｜tool▁calls▁end｜>"


def _kimi_k2(content: str, calls: list[Call]) -> str:
    if not calls:
        return content
    return content + "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
        f"{json.dumps(args, ensure_ascii=False)}<|tool_call_end|>" for i, (name, args) in enumerate(calls)
    ) + "<|tool_calls_section_end|>"


def _gpt_oss(content: str, calls: list[Call]) -> str:
    """OpenAI's harmony guide: each call a commentary message to=functions.NAME, JSON, ended by <|call|>."""
    return content + "".join(f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                             f"{json.dumps(args, ensure_ascii=False)}<|call|>" for name, args in calls)


RENDER: dict[str, Callable[[str, list[Call]], str]] = {
    "qwen3_coder": _qwen3_coder, "glm45": _glm45, "glm47": _glm47, "minimax-m2": _minimax_m2,
    "deepseekv3": _deepseekv3, "deepseekv31": _deepseekv31, "deepseekv32": _deepseekv32, "kimi_k2": _kimi_k2,
    "gpt-oss": _gpt_oss, "minimax-m3": _minimax_m2, "minimax": _minimax_m2,
}
CALL_CLOSE = {"qwen3_coder": "</function>", "glm45": "</tool_call>", "glm47": "</tool_call>",
              "minimax-m2": "</invoke>", "deepseekv3": "<｜tool▁call▁end｜>",
              "deepseekv31": "<｜tool▁call▁end｜>", "deepseekv32": "</｜DSML｜invoke>", "kimi_k2": "<|tool_call_end|>",
              "gpt-oss": "<|call|>", "minimax-m3": "</invoke>", "minimax": "</invoke>"}
REGION_START = {"qwen3_coder": "<tool_call>", "glm45": "<tool_call>", "glm47": "<tool_call>",
                "minimax-m2": "<minimax:tool_call>", "deepseekv3": "<｜tool▁calls▁begin｜>",
                "deepseekv31": "<｜tool▁calls▁begin｜>", "deepseekv32": "<｜DSML｜function_calls>",
                "kimi_k2": "<|tool_calls_section_begin|>", "gpt-oss": "<|start|>assistant<|channel|>commentary to=",
                "minimax-m3": "<minimax:tool_call>", "minimax": "<minimax:tool_call>"}


def chunkings(text: str, seed: int, count: int = 30) -> list[list[str]]:
    """Char by char, whole, and `count` seeded random cuts (small pieces, so markers get split)."""
    rng = random.Random(seed)
    out = [list(text), [text]]
    for _ in range(count):
        pieces, i = [], 0
        while i < len(text):
            n = rng.choice((1, 1, 2, 3, 5, 8, 13))
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def run_stream(parser: str, pieces: list[str], tools=TOOLS) -> tuple[str, list[dict], list[str]]:
    """Feed the pieces; check the delta shapes; return (content, calls, raw argument strings)."""
    stream = ToolCallStream(parser, tools)
    content, deltas = [], []
    for piece in [*pieces, None]:
        c, d = stream.feed(piece) if piece is not None else stream.finish()
        content.append(c)
        deltas += d
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids = set()
    for d in deltas:
        i = d["index"]
        if i not in names:
            assert i == len(names), "calls are indexed 0, 1, ... in order"
            assert d["type"] == "function" and d["id"].startswith("call_") and d["id"] not in ids
            assert d["function"]["arguments"] == ""
            ids.add(d["id"])
            names[i], args[i] = d["function"]["name"], ""
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            args[i] += d["function"]["arguments"]
    raw = [args[i] for i in range(len(names))]
    calls = [{"name": names[i], "arguments": json.loads(raw[i])} for i in range(len(names))]
    return "".join(content), calls, raw


def check_everywhere(parser: str, text: str, content: str, calls: list[Call], seed: int = 0, tools=TOOLS):
    expected = [{"name": n, "arguments": a} for n, a in calls]
    got_content, got_calls = parse_tool_calls(parser, text, tools)
    assert (got_content, got_calls) == (content, expected)
    for pieces in chunkings(text, seed):
        s_content, s_calls, raw = run_stream(parser, pieces, tools)
        assert (s_content, s_calls) == (content, expected), pieces
        assert raw == [json.dumps(c["arguments"], ensure_ascii=False) for c in got_calls]
        assert raw == [dump_arguments(c["arguments"]) for c in got_calls]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("parser", PARSERS)
def test_rendered_outputs(parser, scenario):
    content, calls = SCENARIOS[scenario]
    check_everywhere(parser, RENDER[parser](content, calls), content, calls, seed=list(SCENARIOS).index(scenario))


def test_every_parser_is_tested():
    assert set(RENDER) == set(PARSERS)


# Byte-exact samples as the models write them, independent of the renderers above.
LITERAL = [
    ("qwen3_coder",
     "I'll look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
     "<parameter=celsius>\nTrue\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
     "I'll look it up.", [("get_weather", {"city": "San Francisco", "celsius": True, "days": 2})]),
    ("qwen3_coder",  # lower-case JSON literals, a value with inner blank lines, a parameter not in the schema
     "<tool_call>\n<function=run_job>\n<parameter=note>\n\nindented\n\n</parameter>\n<parameter=limit>\nnull\n"
     "</parameter>\n<parameter=extra>\n5\n</parameter>\n</function>\n</tool_call>",
     "", [("run_job", {"note": "\nindented\n", "limit": None, "extra": "5"})]),
    ("glm45",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>5</arg_value>\n</tool_call>",
     "", [("get_weather", {"city": "北京", "days": 5})]),
    ("glm47",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value><arg_key>zip</arg_key>"
     "<arg_value>100000</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key>"
     "<arg_value>上海</arg_value></tool_call>",
     "", [("get_weather", {"city": "北京", "zip": "100000"}), ("get_weather", {"city": "上海"})]),
    ("minimax-m2",
     'Checking.\n<minimax:tool_call>\n<invoke name="run_job">\n<parameter name="opts">{"a": [1, {"b": null}]}'
     '</parameter>\n<parameter name="ratio">1e-3</parameter>\n</invoke>\n</minimax:tool_call>',
     "Checking.", [("run_job", {"opts": {"a": [1, {"b": None}]}, "ratio": 0.001})]),
    ("deepseekv3",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
     '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "", [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Paris"})]),
    ("deepseekv31",
     'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Tokyo", "days": 1}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Sure.", [("get_weather", {"city": "Tokyo", "days": 1})]),
    ("deepseekv32",
     '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
     'string="true">杭州</｜DSML｜parameter>\n<｜DSML｜parameter name="zip" string="true">310000</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
     "", [("get_weather", {"city": "杭州", "zip": "310000", "days": 2})]),
    ("kimi_k2",  # the singular section spelling, and no closing section marker before EOS
     "<|tool_call_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     '{"city": "Beijing"}<|tool_call_end|>',
     "", [("get_weather", {"city": "Beijing"})]),
    ("gpt-oss",  # OpenAI's harmony guide: a preamble, then a call without a space before <|constrain|>
     "**Action plan**: check the weather.<|start|>assistant<|channel|>commentary to=functions.get_weather"
     '<|constrain|>json<|message|>{"city":"San Francisco"}<|call|>',
     "**Action plan**: check the weather.", [("get_weather", {"city": "San Francisco"})]),
    ("gpt-oss",  # the recipient after the role
     '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Tokyo"}'
     "<|call|>", "", [("get_weather", {"city": "Tokyo"})]),
]


@pytest.mark.parametrize("case", range(len(LITERAL)))
def test_literal_samples(case):
    parser, text, content, calls = LITERAL[case]
    check_everywhere(parser, text, content, calls, seed=case)


@pytest.mark.parametrize("parser", PARSERS)
def test_truncated_call_is_content(parser):
    text = RENDER[parser]("Let me check.", [("get_weather", {"city": "Paris", "days": 3})])
    truncated = text[:text.index(CALL_CLOSE[parser]) + 2]  # stopped inside the closing marker
    check_everywhere(parser, truncated, truncated, [])
    cut_in_marker = text[:text.index(REGION_START[parser]) + 3]
    check_everywhere(parser, cut_in_marker, cut_in_marker, [])


@pytest.mark.parametrize("parser", PARSERS)
def test_unknown_function_is_content(parser):
    text = RENDER[parser]("Let me check.", [("launch_rockets", {"count": 3})])
    check_everywhere(parser, text, text, [])
    check_everywhere(parser, text, text, [], tools=None)  # no tools: nothing is a call


@pytest.mark.parametrize("parser", PARSERS)
def test_broken_call_is_content(parser):
    text = RENDER[parser]("", [("get_weather", {"city": "Paris"})])
    at = text.index(CALL_CLOSE[parser])
    broken = text[:at] + "oops" + text[at:]  # bad JSON, or junk between parameters
    check_everywhere(parser, broken, broken, [])


@pytest.mark.parametrize("parser", PARSERS)
def test_good_call_then_broken_call(parser):
    text = RENDER[parser]("", [("get_weather", {"city": "Paris"}), ("launch_rockets", {"count": 1})])
    content, calls = parse_tool_calls(parser, text, TOOLS)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert "launch_rockets" in content and "Paris" not in content
    check_everywhere(parser, text, content, [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("parser", PARSERS)
def test_marker_in_prose_then_real_call(parser):
    prose = f"Calls start with {REGION_START[parser]} as you know."
    call = ("get_weather", {"city": "Rome"})
    check_everywhere(parser, RENDER[parser](prose, [call]), prose, [call])


@pytest.mark.parametrize("parser", PARSERS)
def test_partial_marker_at_end_is_content(parser):
    text = "Almost a call " + REGION_START[parser][:-1]
    check_everywhere(parser, text, text, [])


@pytest.mark.parametrize("parser", PARSERS)
def test_text_around_calls_keeps_its_whitespace(parser):
    """The content is the text outside the call markup, its whitespace as written (SGLang's MiniMax-M2
    detector joins the text before and after each call block verbatim: "Checking now.\n\nI will ...").
    Whitespace between a call and the content's start or end is still not content."""
    oslo, job = ("get_weather", {"city": "Oslo"}), ("run_job", {})
    one = RENDER[parser]("", [oslo]).strip()  # the call markup as the template writes it
    two = RENDER[parser]("", [oslo, job]).strip()
    check_everywhere(parser, f"Checking now.\n\n{one}I will report back.", "Checking now.\n\nI will report back.",
                     [oslo])
    check_everywhere(parser, f"Checking now.{one}\n\nI will report back.", "Checking now.\n\nI will report back.",
                     [oslo], seed=1)
    check_everywhere(parser, f"Checking now.\n{one}\nI will report back.", "Checking now.\n\nI will report back.",
                     [oslo], seed=2)
    check_everywhere(parser, f"A. {one}\tB.\n{two}\n\nC.\n", "A. \tB.\n\n\nC.\n", [oslo, oslo, job], seed=3)
    check_everywhere(parser, f"\n{one}\n\nDone.\n\n{one} ", "Done.", [oslo, oslo], seed=4)


def test_streaming_holds_back_only_possible_markers():
    stream = ToolCallStream("qwen3_coder", TOOLS)
    assert stream.feed("Hello <b>world</b>") == ("Hello <b>world</b>", [])
    assert stream.feed(" <tool_") == ("", [])  # may be a call: held back, with the space before it
    assert stream.feed("box>") == (" <tool_box>", [])  # decided: prose
    assert stream.feed("\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n") == ("", [])
    content, deltas = stream.feed("</parameter>\n</function>\n</tool_call>")
    assert content == "" and [d["function"] for d in deltas] == [
        {"name": "get_weather", "arguments": ""}, {"arguments": '{"city": "Rome"}'}]
    assert stream.feed("\n\nDone.") == ("\n\n\n\nDone.", [])  # the text's own whitespace, both sides of the call
    assert stream.finish() == ("", [])


def test_unknown_parser_names_the_supported_ones():
    with pytest.raises(ValueError, match="qwen3_coder") as err:
        parse_tool_calls("hermes", "hi", TOOLS)
    assert all(name in str(err.value) for name in PARSERS)


# ---- with a reasoning parser: the server's pipeline (chat_output.OutputStream), every pairing --------
THINK_OPEN = {p: reasoning.think_format(p).open for p in reasoning.PARSERS}


def run_output(plan: OutputPlan, pieces: list[str]) -> tuple[str, str, list[dict]]:
    """Stream the pieces through the server's pipeline -> (reasoning, content, calls with parsed arguments)."""
    stream = OutputStream(plan)
    thought, content, names, args = "", "", {}, {}
    for piece in [stream.feed(p) for p in pieces] + [stream.finish()]:
        thought, content = thought + piece.reasoning, content + piece.content
        for d in piece.tool_calls:
            names.setdefault(d["index"], d["function"].get("name"))
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return thought, content, [{"name": names[i], "arguments": json.loads(args[i])} for i in sorted(names)]


@pytest.mark.parametrize("tool_parser", PARSERS)
@pytest.mark.parametrize("reasoning_parser", [p for p in reasoning.PARSERS if not reasoning.think_format(p).harmony])
def test_call_inside_an_unclosed_think_block_is_a_call(reasoning_parser, tool_parser):
    """SGLang's rule (its reasoning detectors' tool_start_token): a call the model starts before closing
    its think block ends the reasoning there and goes to the tool parser, whole and streamed (markers
    cut across deltas), whether the model or the prompt opened the block."""
    call = ("get_weather", {"city": "Paris", "days": 3})
    markup = RENDER[tool_parser]("", [call])
    expected = ("I need the weather first.", "", [{"name": call[0], "arguments": call[1]}])
    for opener, opened in ((THINK_OPEN[reasoning_parser] + "\n", False), ("", True)):
        plan = OutputPlan(reasoning_parser, opened, tool_parser, TOOLS)
        text = f"{opener}I need the weather first.\n{markup}"
        out = parse_output(plan, text)
        got = (out.reasoning, out.content, [{"name": c.name, "arguments": json.loads(c.arguments)}
                                            for c in out.tool_calls])
        assert got == expected, text
        for pieces in chunkings(text, seed=len(markup), count=6):
            assert run_output(plan, pieces) == expected, pieces
