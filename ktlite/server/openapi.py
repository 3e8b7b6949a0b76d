"""The OpenAPI 3.1 description of ktlite's HTTP endpoints, served at `GET /openapi.json`.

Hand-written (no schema library): it lists what the server accepts and what it returns, so
clients and fuzzers (tests/test_fuzz.py draws its request bodies from these schemas) agree with
`ktlite/server/protocol.py`. Unknown fields are ignored by the server, as on OpenAI.
"""

from __future__ import annotations

import copy
from typing import Any

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 8}, {"type": "null"}]}

# Sampling fields shared by both generation endpoints (OpenAI's, then SGLang/vLLM extras).
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "description": "The served model name, 'default', or the model path.",
              "examples": ["default"]},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "examples": [1, 4, 16]},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "description": "-1 or 0: off"},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "seed": {"type": ["integer", "null"]},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0},
    "ignore_eos": {"type": ["boolean", "null"]},
    "stop": _STOP,
    "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
    "skip_special_tokens": {"type": ["boolean", "null"]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": ["integer", "null"], "enum": [1, None], "description": "Only 1 is supported."},
    "user": {"type": ["string", "null"]},
}

_CONTENT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART, "minItems": 1,
                                                   "maxItems": 4}]},
        "name": {"type": "string"},
    },
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 6},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        **_SAMPLING,
    },
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": 64},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1,
                                        "maxItems": 64}, "minItems": 1, "maxItems": 4},
        ]},
        "echo": {"type": ["boolean", "null"]},
        **_SAMPLING,
    },
}

_USAGE = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                           "completion_tokens": {"type": "integer"},
                                           "total_tokens": {"type": "integer"}}}

_JSON_ERRORS = {
    str(code): {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for code, text in ((400, "invalid request (bad JSON, bad types, too long for the context)"),
                       (401, "missing or wrong API key"), (404, "unknown model"),
                       (413, "body larger than --max-request-bytes"),
                       (503, "at capacity (--max-queued-requests) or shutting down; see Retry-After"))
}


def _generation(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {
            "200": {"description": "the completion, or with stream=true server-sent events ending in 'data: [DONE]'",
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_JSON_ERRORS,
        },
    }}


def _get(summary: str, schema: dict[str, Any] | None = None, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {
        "description": summary, "content": {content_type: {"schema": schema or {"type": "object"}}}}}}}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "ktlite OpenAI-compatible API", "version": "0.1.0"},
    "paths": {
        "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
        "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
        "/v1/models": _get("The served model"),
        "/v1/models/{model}": {"get": {**_get("One model")["get"], "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/health": _get("Liveness", {"type": "object", "properties": {"status": {"type": "string"}}}),
        "/health_generate": _get("Liveness (SGLang's name)"),
        "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
        "/openapi.json": _get("This document"),
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "ChatCompletionRequest": CHAT_REQUEST,
            "CompletionRequest": COMPLETION_REQUEST,
            "ChatCompletion": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"const": "chat.completion"}, "model": {"type": "string"},
                "choices": {"type": "array"}, "usage": _USAGE}},
            "Completion": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"const": "text_completion"}, "model": {"type": "string"},
                "choices": {"type": "array"}, "usage": _USAGE}},
            "Error": _ERROR,
        },
    },
}


def openapi(api_key_required: bool = False) -> dict[str, Any]:
    """The document (a copy); with an API key, /v1/* paths declare the bearer scheme."""
    doc = copy.deepcopy(OPENAPI)
    if api_key_required:
        for path, item in doc["paths"].items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
