"""The tool-call formats models emit, by SGLang's parser names, as data for the scanner in stream.py.

A format is a *region* (opened by one of `starts`, closed by one of `ends`) holding one or more
*calls*, each from `call_open` to the first `call_close` after it; `parse_call` turns the text
between those two into (name, arguments) or None when it is malformed. A format with no `ends`
has exactly one call per region, starting right after the region's opening marker.

Markers are byte-exact copies of what the models' chat templates render (the deepseekv3* ones use
the full-width bar U+FF5C and the lower-eighth block U+2581, not `|` and `_`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ktlite.server.tool_parsers.values import coerce, json_object, properties

Schemas = Mapping[str, Mapping[str, Any]]  # function name -> parameters schema
ParsedCall = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class ToolFormat:
    starts: tuple[str, ...]
    ends: tuple[str, ...]
    call_open: str
    call_close: str
    parse_call: Callable[[str, Schemas], ParsedCall | None]


def _tagged_pairs(text: str, pattern: re.Pattern[str]) -> list[re.Match[str]] | None:
    """All matches of `pattern` in text, or None if anything but whitespace lies between them."""
    matches, pos = [], 0
    for m in pattern.finditer(text):
        if text[pos:m.start()].strip():
            return None
        matches.append(m)
        pos = m.end()
    return None if text[pos:].strip() else matches


# --- qwen3_coder: <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>
_QWEN_NAME = re.compile(r"([^>\n]+)>")
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _parse_qwen3_coder(body: str, schemas: Schemas) -> ParsedCall | None:
    head = _QWEN_NAME.match(body)
    if head is None:
        return None
    name = head[1].strip()
    pairs = _tagged_pairs(body[head.end():], _QWEN_PARAM)
    if pairs is None:
        return None
    props = properties(schemas.get(name))
    args = {}
    for m in pairs:
        value = m[2]
        # The template writes "<parameter=P>\n" + value + "\n</parameter>": drop exactly those newlines.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = m[1].strip()
        args[key] = coerce(value, props.get(key))
    return name, args


# --- glm45: <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>
# --- glm47: the same without the newlines; one parser reads both.
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _parse_glm(body: str, schemas: Schemas) -> ParsedCall | None:
    cut = body.find("<arg_key>")
    name = (body if cut < 0 else body[:cut]).strip()
    pairs = _tagged_pairs("" if cut < 0 else body[cut:], _GLM_PAIR)
    if not name or pairs is None:
        return None
    props = properties(schemas.get(name))
    return name, {m[1].strip(): coerce(m[2], props.get(m[1].strip())) for m in pairs}


# --- minimax-m2: <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="P">V</parameter>\n</invoke>\n
#     </minimax:tool_call>
_NAME_ATTR = re.compile(r'\s+name="([^"]*)"\s*>')  # the rest of `<invoke name="NAME">`
_MINIMAX_PARAM = re.compile(r'<parameter\s+name="([^"]*)"\s*>(.*?)</parameter>', re.DOTALL)


def _parse_minimax(body: str, schemas: Schemas) -> ParsedCall | None:
    head = _NAME_ATTR.match(body)
    pairs = None if head is None else _tagged_pairs(body[head.end():], _MINIMAX_PARAM)
    if head is None or pairs is None:
        return None
    name = head[1].strip()
    props = properties(schemas.get(name))
    return name, {m[1]: coerce(m[2], props.get(m[1])) for m in pairs}


# --- deepseekv32 (DSML): <｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n
#     <｜DSML｜parameter name="P" string="true|false">V</｜DSML｜parameter>\n</｜DSML｜invoke>\n
#     </｜DSML｜function_calls>
_DSML = "\uff5cDSML\uff5c"
_DSML_PARAM = re.compile(
    rf'<{_DSML}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</{_DSML}parameter>', re.DOTALL)


def _parse_dsml(body: str, schemas: Schemas) -> ParsedCall | None:
    head = _NAME_ATTR.match(body)
    pairs = None if head is None else _tagged_pairs(body[head.end():], _DSML_PARAM)
    if head is None or pairs is None:
        return None
    name = head[1].strip()
    props = properties(schemas.get(name))
    # string="true": the value is the raw string; "false": JSON (typed by the schema when it has one).
    return name, {m[1]: m[3] if m[2] == "true" else coerce(m[3], props.get(m[1]), untyped_json=True)
                  for m in pairs}


# --- deepseekv3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
#     <｜tool▁call▁end｜><｜tool▁calls▁end｜>  (calls separated by "\n")
def _ds(marker: str) -> str:
    """A deepseekv3-style special token: `tool_calls_begin` -> `<｜tool▁calls▁begin｜>`."""
    return "<\uff5c" + marker.replace("_", "\u2581") + "\uff5c>"


_DS_SEP = _ds("tool_sep")
_FENCED_JSON = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.DOTALL)


def _parse_deepseekv3(body: str, schemas: Schemas) -> ParsedCall | None:
    kind, sep, rest = body.partition(_DS_SEP)
    if not sep or kind.strip() not in ("function", ""):
        return None
    name, _, arguments = rest.partition("\n")
    fenced = _FENCED_JSON.fullmatch(arguments.strip())
    args = json_object(fenced[1] if fenced else arguments)
    return None if args is None or not name.strip() else (name.strip(), args)


# --- deepseekv31: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>
#     <｜tool▁calls▁end｜>
def _parse_deepseekv31(body: str, schemas: Schemas) -> ParsedCall | None:
    name, sep, arguments = body.partition(_DS_SEP)
    args = json_object(arguments) if sep else None
    return None if args is None or not name.strip() else (name.strip(), args)


# --- kimi_k2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
#     <|tool_call_end|><|tool_calls_section_end|>
_KIMI_ID = re.compile(r"\s*(?:functions\.)?([\w.\-]+):\d+\s*")


def _parse_kimi_k2(body: str, schemas: Schemas) -> ParsedCall | None:
    call_id, sep, arguments = body.partition("<|tool_call_argument_begin|>")
    m = _KIMI_ID.fullmatch(call_id)
    args = json_object(arguments) if sep and m else None
    return None if args is None else (m[1], args)


# --- gpt-oss (harmony): [<|start|>assistant]<|channel|>commentary to=functions.NAME [<|constrain|>json]<|message|>{json}
#     <|call|>, or with the recipient after the role: <|start|>assistant to=functions.NAME<|channel|>commentary ...
#     One call per message; `<|call|>` is the stop token that ends it.
_HARMONY_CALL = re.compile(r"functions\.([\w.\-]+)\s*(?:<\|channel\|>\s*commentary\s*)?(?:<\|constrain\|>\s*\w+\s*)?"
                           r"<\|message\|>(.*)", re.DOTALL)


def _parse_harmony(body: str, schemas: Schemas) -> ParsedCall | None:
    m = _HARMONY_CALL.fullmatch(body)
    args = json_object(m[2]) if m else None
    return None if args is None else (m[1], args)


_GLM = ToolFormat(("<tool_call>",), (), "", "</tool_call>", _parse_glm)
_MINIMAX = ToolFormat(("<minimax:tool_call>",), ("</minimax:tool_call>",), "<invoke", "</invoke>", _parse_minimax)

FORMATS: dict[str, ToolFormat] = {
    "qwen3_coder": ToolFormat(("<tool_call>",), ("</tool_call>",), "<function=", "</function>", _parse_qwen3_coder),
    "deepseekv3": ToolFormat((_ds("tool_calls_begin"),), (_ds("tool_calls_end"),), _ds("tool_call_begin"),
                             _ds("tool_call_end"), _parse_deepseekv3),
    "deepseekv31": ToolFormat((_ds("tool_calls_begin"),), (_ds("tool_calls_end"),), _ds("tool_call_begin"),
                              _ds("tool_call_end"), _parse_deepseekv31),
    "deepseekv32": ToolFormat((f"<{_DSML}function_calls>",), (f"</{_DSML}function_calls>",), f"<{_DSML}invoke",
                              f"</{_DSML}invoke>", _parse_dsml),
    # The kimi_k2 vocabulary also has singular section tokens; vLLM and SGLang accept both spellings.
    "kimi_k2": ToolFormat(("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
                          ("<|tool_calls_section_end|>", "<|tool_call_section_end|>"),
                          "<|tool_call_begin|>", "<|tool_call_end|>", _parse_kimi_k2),
    "glm45": _GLM,
    "glm47": _GLM,
    "minimax-m2": _MINIMAX,
    # MiniMax-M3 keeps M2's call syntax (MiniMax's M2.x guides; no other M3 format is published): SGLang's names
    "minimax-m3": _MINIMAX,
    "minimax": _MINIMAX,
    "gpt-oss": ToolFormat(("<|start|>assistant<|channel|>commentary to=", "<|channel|>commentary to=",
                           "<|start|>assistant to="), (), "", "<|call|>", _parse_harmony),
}
