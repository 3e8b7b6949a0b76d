"""Tool calls in model output, in the formats real models emit, -> OpenAI `tool_calls`.

    content, calls = parse_tool_calls(parser, text, tools)   # calls: [{"name": str, "arguments": dict}]
    s = ToolCallStream(parser, tools)
    s.feed(text_delta) -> (content_delta, call_deltas); s.finish() -> (content_delta, call_deltas)

`parser` is one of `PARSERS` (SGLang's names); `tools` is the request's OpenAI `tools` list. A call
to a function not in `tools` is not a call: its text stays content. Streamed pieces concatenate to
the non-streamed answer; each call's argument fragments concatenate to `dump_arguments(arguments)`
(`json.dumps(arguments, ensure_ascii=False)`). Formats: formats.py; scanning rules: stream.py;
argument typing by JSON schema: values.py.
"""

from ktlite.server.tool_parsers.formats import FORMATS
from ktlite.server.tool_parsers.stream import ToolCallStream, dump_arguments, parse_tool_calls

PARSERS: tuple[str, ...] = tuple(sorted(FORMATS))

__all__ = ["PARSERS", "ToolCallStream", "dump_arguments", "parse_tool_calls"]
