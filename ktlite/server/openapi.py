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
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 128, "examples": [1, 2],
          "description": "choices per prompt; they share the prompt's KV through the prefix cache"},
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
        "tool_call_id": {"type": "string", "description": "role tool: the call this message answers"},
        "tool_calls": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "required": ["id", "type", "function"],
            "properties": {"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                           "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                               "name": {"type": "string"},
                               "arguments": {"type": "string", "description": "JSON text",
                                             "examples": ['{"city": "Paris"}']}}}}}},
    },
}

# A small JSON schema: tool parameters and response_format schemas (the server enforces any it can).
_SCHEMA = {"type": "object", "description": "a JSON schema", "properties": {
    "type": {"type": "string", "enum": ["object"]},
    "properties": {"type": "object", "properties": {
        "flag": {"type": "object", "properties": {"type": {"type": "string", "enum": ["boolean"]}}},
        "level": {"type": "object", "properties": {"type": {"type": "string", "enum": ["integer"]},
                                                   "minimum": {"type": "integer"}, "maximum": {"type": "integer"}}}}},
    "required": {"type": "array", "items": {"type": "string", "enum": ["flag", "level"]}, "maxItems": 2}}}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "examples": ["get_weather"]}, "description": {"type": "string"},
        "parameters": _SCHEMA}}}}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 6},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "tools": {"type": ["array", "null"], "items": _TOOL, "maxItems": 3,
                  "description": "rendered by the chat template; calls parsed by --tool-call-parser"},
        "tool_choice": {"anyOf": [
            {"type": "string", "enum": ["auto", "none", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "examples": ["get_weather"]}}}}},
            {"type": "null"}],
            "description": "required / a named function: the output is constrained to one call"},
        "response_format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"type": "string", "enum": ["json_schema"]},
                "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
                    "name": {"type": "string"}, "strict": {"type": "boolean"}, "schema": _SCHEMA}}}},
            {"type": "null"}],
            "description": "json_object / json_schema: compact JSON enforced by grammar-constrained sampling"},
        "chat_template_kwargs": {"type": ["object", "null"], "description": "extra chat template variables",
                                 "properties": {"enable_thinking": {"type": "boolean"},
                                                "thinking": {"type": "boolean"}}},
        "separate_reasoning": {"type": ["boolean", "null"],
                               "description": "false: thinking stays in content even with --reasoning-parser"},
        "logprobs": {"type": ["boolean", "null"], "description": "each output token's logprob (raw model distribution)"},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20,
                         "description": "alternatives per token; needs logprobs: true"},
        **_SAMPLING,
    },
}

_BLOCKS = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"anyOf": [
    {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"type": "string", "enum": ["tool_use"]}, "id": {"type": "string"},
        "name": {"type": "string", "examples": ["get_weather"]}, "input": {"type": "object"}}},
    {"type": "object", "required": ["type", "tool_use_id", "content"], "properties": {
        "type": {"type": "string", "enum": ["tool_result"]}, "tool_use_id": {"type": "string"},
        "content": {"type": "string"}}},
    {"type": "object", "required": ["type", "thinking"], "properties": {
        "type": {"type": "string", "enum": ["thinking"]}, "thinking": {"type": "string"},
        "signature": {"type": "string"}}}]}}

_ANTHROPIC_CHAT = {
    "model": {"type": "string", "examples": ["default"]},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 2, "items": {
        "type": "object", "required": ["type", "text"], "properties": {
            "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
    "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"anyOf": [{"type": "string"}, _BLOCKS]}}}},
    "tools": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "required": ["name", "input_schema"], "properties": {
            "name": {"type": "string", "examples": ["get_weather"]}, "description": {"type": "string"},
            "input_schema": _SCHEMA}}},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
        "name": {"type": "string", "examples": ["get_weather"]}}},
    "thinking": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer"}}},
}

MESSAGES_REQUEST = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        **_ANTHROPIC_CHAT,
        "max_tokens": {"type": "integer", "minimum": 1, "examples": [1, 4, 16]},
        "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer"},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
    },
}

_TEXT_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 2, "items": {
    "type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}}]}

RESPONSES_REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"type": "string", "examples": ["default"]},
        "instructions": {"type": ["string", "null"]},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "maxItems": 4, "items": {"anyOf": [
            {"type": "object", "required": ["role", "content"], "properties": {
                "type": {"const": "message"}, "role": {"type": "string", "enum": ["user", "developer", "assistant"]},
                "content": _TEXT_PARTS}},
            {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
                "type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
                "arguments": {"type": "string"}}},
            {"type": "object", "required": ["type", "call_id", "output"], "properties": {
                "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": _TEXT_PARTS}},
            {"type": "object", "required": ["type", "summary"], "properties": {
                "type": {"const": "reasoning"}, "summary": {"type": "array", "maxItems": 1, "items": {
                    "type": "object", "required": ["type", "text"], "properties": {
                        "type": {"const": "summary_text"}, "text": {"type": "string"}}}}}}]}}]},
        "tools": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"const": "function"}, "name": {"type": "string", "examples": ["get_weather"]},
                "description": {"type": "string"}, "parameters": _SCHEMA}}},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                  {"type": "object", "required": ["type", "name"], "properties": {
                                      "type": {"const": "function"}, "name": {"type": "string"}}}]},
        "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}, "schema": _SCHEMA}}}},
        "previous_response_id": {"type": ["string", "null"]},
        "store": {"type": "boolean"},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1, "examples": [1, 4, 16]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
    },
}

COUNT_TOKENS_REQUEST = {"type": "object", "required": ["model", "messages"], "properties": _ANTHROPIC_CHAT}

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
        "echo": {"type": ["boolean", "null"], "description": "with logprobs: the prompt tokens' logprobs too"},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5,
                     "description": "logprobs of each token with this many alternatives"},
        "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": 128,
                    "description": ">= n samples; the n with the highest cumulative logprob are returned"},
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


_ANTHROPIC_ERRORS = {
    code: {"description": value["description"], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
    for code, value in _JSON_ERRORS.items()
}


def _generation(summary: str, request: str, response: str, errors: dict[str, Any] = _JSON_ERRORS,
                stream: str = "server-sent events ending in 'data: [DONE]'") -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {
            "200": {"description": f"the reply, or with stream=true {stream}",
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **errors,
        },
    }}


def _get(summary: str, schema: dict[str, Any] | None = None, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {
        "description": summary, "content": {content_type: {"schema": schema or {"type": "object"}}}}}}}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "ktlite OpenAI- and Anthropic-compatible API", "version": "0.1.0"},
    "paths": {
        "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
        "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
        "/v1/responses": _generation("OpenAI Responses API", "ResponsesRequest", "Response",
                                     stream="named events (response.created ... response.completed)"),
        "/v1/messages": _generation("Anthropic Messages API", "MessagesRequest", "Message", _ANTHROPIC_ERRORS,
                                    "Anthropic's named events (message_start ... message_stop)"),
        "/v1/messages/count_tokens": {"post": {
            "summary": "Anthropic: prompt tokens of a Messages request",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/CountTokensRequest"}}}},
            "responses": {"200": {"description": "the count", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"input_tokens": {"type": "integer"}}}}}}, **_ANTHROPIC_ERRORS}}},
        "/v1/models": _get("The served model"),
        "/v1/models/{model}": {"get": {**_get("One model")["get"], "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/health": _get("Liveness", {"type": "object", "properties": {"status": {"type": "string"}}}),
        "/health_generate": _get("Liveness (SGLang's name)"),
        "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
        "/openapi.json": _get("This document"),
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        "schemas": {
            "ChatCompletionRequest": CHAT_REQUEST,
            "CompletionRequest": COMPLETION_REQUEST,
            "ChatCompletion": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"const": "chat.completion"}, "model": {"type": "string"},
                "choices": {"type": "array"}, "usage": _USAGE}},
            "Completion": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"const": "text_completion"}, "model": {"type": "string"},
                "choices": {"type": "array"}, "usage": _USAGE}},
            "ResponsesRequest": RESPONSES_REQUEST,
            "Response": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"const": "response"}, "model": {"type": "string"},
                "status": {"type": "string"}, "output": {"type": "array"}, "usage": {"type": "object", "properties": {
                    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                    "total_tokens": {"type": "integer"}, "input_tokens_details": {"type": "object", "properties": {
                        "cached_tokens": {"type": "integer"}}}}}}},
            "MessagesRequest": MESSAGES_REQUEST,
            "CountTokensRequest": COUNT_TOKENS_REQUEST,
            "Message": {"type": "object", "properties": {
                "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                "content": {"type": "array"}, "stop_reason": {"type": ["string", "null"]},
                "stop_sequence": {"type": ["string", "null"]}, "usage": {"type": "object", "properties": {
                    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                    "cache_read_input_tokens": {"type": "integer"},
                    "cache_creation_input_tokens": {"type": "integer"}}}}},
            "Error": _ERROR,
            "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
                "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                      "properties": {"type": {"type": "string"},
                                                                     "message": {"type": "string"}}}}},
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
                    op["security"] = [{"bearer": []}, {"x-api-key": []}]
    return doc
