"""gpt-oss's harmony format (`--reasoning-parser gpt-oss`, `--tool-call-parser gpt-oss`): the example outputs of
OpenAI's harmony guide (openai-cookbook articles/openai-harmony.md) split into reasoning, content and tool calls,
whole and streamed under many chunkings, through the server's pipeline (chat_output.OutputStream)."""

from __future__ import annotations

import json

import pytest
from test_reasoning import check_everywhere, chunkings
from test_tool_parsers import run_output

from ktlite.server.chat_output import OutputPlan, parse_output
from ktlite.server.reasoning import prompt_opens_think, think_format

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}
         for name, props in (("get_weather", {"location": {"type": "string"}}),
                             ("get_current_weather", {"location": {"type": "string"}, "format": {"type": "string"}}),
                             ("generate_file", {"template": {"type": "string"}, "path": {"type": "string"}}))]

# the guide's outputs, byte for byte
ARITHMETIC = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
              "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
WEATHER_CALL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>"
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>')
PREAMBLE = "**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript for the Node.js server\n" \
           "3. Start the server\n---\nWill start executing the plan step by step"
PREAMBLE_CALL = ("<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary"
                 f"<|message|>{PREAMBLE}<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file"
                 '<|constrain|>json<|message|>{"template": "basic_html", "path": "index.html"}<|call|>')


@pytest.mark.parametrize("text, expected", [
    (ARITHMETIC, ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.")),
    # two chain-of-thought messages before the answer: one reasoning, a blank line between them
    ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.", ("First.\n\nSecond.", "Done.")),
    # stopped inside the chain of thought: all of it is reasoning; cut inside a header: nothing of it is said
    ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?"', ('User asks: "What is 2 + 2?"', "")),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|chan", ("Easy.", "")),
    ("<|channel|>final<|message|>4, and <|end is not a marker.<|return|>", ("", "4, and <|end is not a marker.")),
    ("No harmony markup <b>here</b>.", ("", "No harmony markup <b>here</b>.")),
    ("", ("", "")),
])
def test_channels_split_whole_and_streamed(text, expected):
    check_everywhere("gpt-oss", text, expected)


def test_prompt_ending_in_an_analysis_header_opens_the_reasoning():
    prompt = "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
    assert not prompt_opens_think("gpt-oss", prompt)
    history = prompt + "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary to=" \
                       'functions.get_weather <|constrain|>json<|message|>{"location":"Oslo"}<|call|>'
    assert not prompt_opens_think("gpt-oss", history + "<|start|>assistant")
    opened = prompt + "<|channel|>analysis<|message|>"
    assert prompt_opens_think("gpt-oss", opened)
    check_everywhere("gpt-oss", "Simple.<|end|><|start|>assistant<|channel|>final<|message|>4", ("Simple.", "4"),
                     opened=True)


def test_thinking_budget_closes_the_analysis_message_and_opens_the_answer():
    fmt = think_format("gpt-oss")
    assert fmt.harmony and fmt.close == "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("text, expected", [
    (WEATHER_CALL, ("Need to use function get_weather.", "", [("get_weather", {"location": "San Francisco"})])),
    # a preamble on the commentary channel is content, shown to the user
    (PREAMBLE_CALL, ("{long chain of thought}", PREAMBLE,
                     [("generate_file", {"template": "basic_html", "path": "index.html"})])),
    # "the recipient might be defined in the role or channel section of the header": in the first message the role
    # is the prompt's `<|start|>assistant`, so the output opens with the recipient
    (' to=functions.get_current_weather<|channel|>commentary <|constrain|>json<|message|>{"location":"SF, CA",'
     '"format":"celsius"}<|call|>', ("", "", [("get_current_weather", {"location": "SF, CA", "format": "celsius"})])),
    # a function the request did not offer is not a call: its message stays content, verbatim
    ("<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>",
     ("", "<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>", [])),
])
def test_tool_calls_through_the_server_pipeline(text, expected):
    plan = OutputPlan("gpt-oss", False, "gpt-oss", TOOLS)
    reasoning, content, calls = expected
    expected = (reasoning, content, [{"name": n, "arguments": a} for n, a in calls])
    out = parse_output(plan, text)
    whole = (out.reasoning, out.content, [{"name": c.name, "arguments": json.loads(c.arguments)} for c in out.tool_calls])
    assert whole == expected
    for pieces in chunkings(text, seed=5):
        assert run_output(plan, pieces) == expected, pieces


def test_without_a_tool_parser_a_call_message_stays_content():
    reasoning, content = parse_output(OutputPlan("gpt-oss"), WEATHER_CALL).reasoning, \
        parse_output(OutputPlan("gpt-oss"), WEATHER_CALL).content
    assert reasoning == "Need to use function get_weather."
    assert content == WEATHER_CALL[WEATHER_CALL.index("<|start|>"):]


def test_markers_that_are_special_tokens_reach_the_parser(tiny_v3, tmp_path):
    """gpt-oss's tokenizer.json marks the harmony markers special ("special": true), which decoding skips by default:
    a chat request with the gpt-oss parser (or with tools and a tool parser) keeps special tokens, as SGLang does, so
    the streamed text still has its channels and splits; a plain request still skips them."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from ktlite.runtime.tokenizer import Tokenizer
    from ktlite.server.protocol import parse_chat

    hf = HFTokenizer.from_file(str(tiny_v3 / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in
                           ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                            "<|constrain|>")])
    hf.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(tiny_v3 / "tokenizer_config.json", tmp_path)
    tok = Tokenizer(tmp_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
    plain = parse_chat(body, tok, 4096, "m")
    harmony = parse_chat(body, tok, 4096, "m", reasoning_parser="gpt-oss")
    with_tools = parse_chat({**body, "tools": TOOLS}, tok, 4096, "m", tool_call_parser="gpt-oss")
    assert plain.params.skip_special_tokens and not harmony.params.skip_special_tokens
    assert not with_tools.params.skip_special_tokens
    ids = tok.encode(ARITHMETIC.removesuffix("<|return|>"), add_bos=False)  # the stop token adds no text
    assert len(ids) < len(tok.encode(ARITHMETIC.replace("<|", "< |"), add_bos=False))  # the markers are one id each

    def streamed(skip: bool) -> str:
        detok = tok.detokenizer([], skip)
        return "".join(detok.push(i) for i in ids) + detok.flush()

    assert "<|channel|>" not in streamed(True)
    out = parse_output(harmony.output, streamed(harmony.params.skip_special_tokens))
    assert (out.reasoning, out.content) == ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
                                           "2 + 2 = 4.")
