"""Argument values: the OpenAI `tools` list -> parameter schemas, and text values -> typed JSON values.

XML-style formats write every argument value as text; its JSON type comes from the tool's schema.
Rules (one for every format):
- the schema allows "string" (alone or in a union) -> the text, unchanged ("02139" stays a string);
- the schema names only other types (integer, number, boolean, null, object, array) -> `json.loads`
  of the stripped text, else Python's `True`/`False`/`None` (templates that render values with
  jinja's `|string` teach the model those), else the text unchanged;
- no type known (parameter not in the schema, or a schema without "type") -> the text, unless the
  format itself marks the value as non-string (`untyped_json=True`), then as above.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_PY_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None}


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """OpenAI `tools` -> {function name: its `parameters` JSON schema ({} when absent)}."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            schemas[fn["name"]] = dict(params) if isinstance(params, Mapping) else {}
    return schemas


def properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def schema_types(schema: Any) -> set[str]:
    """Every JSON type a schema admits: `type` (string or list), enum/const values, anyOf/oneOf/allOf."""
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set()
    if isinstance(declared, list):
        types |= {t for t in declared if isinstance(t, str)}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        for branch in branches if isinstance(branches, list) else ():
            types |= schema_types(branch)
    enum = schema.get("enum")
    types |= {_json_type(v) for v in (enum if isinstance(enum, list) else ())}
    if "const" in schema:
        types.add(_json_type(schema["const"]))
    return types


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would make the arguments invalid JSON


def json_object(text: str) -> dict[str, Any] | None:
    """Parse text that must be one JSON object (a call's arguments); None when it is not."""
    try:
        value = json.loads(text.strip(), parse_constant=_reject_constant)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def coerce(text: str, schema: Any, untyped_json: bool = False) -> Any:
    """A text argument value -> its JSON value, by the parameter's schema (rules in the module doc)."""
    types = schema_types(schema)
    if "string" in types or (not types and not untyped_json):
        return text
    stripped = text.strip()
    try:
        return json.loads(stripped, parse_constant=_reject_constant)
    except ValueError:
        return _PY_LITERALS.get(stripped, text)
