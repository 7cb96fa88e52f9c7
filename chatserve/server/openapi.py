"""The hand-written OpenAPI 3.1 description served at /openapi.json (also the schemathesis fuzz target).

Describes the routes of openai_routes.py; the WebSocket is documented in docs/api.md.
Not validation: the server enforces its own rules (protocol.py) whatever this schema says.
"""
from __future__ import annotations

from typing import Any

_ERR = {"$ref": "#/components/schemas/Error"}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": "error", "content": {"application/json": {"schema": _ERR}}}
            for c in codes}


_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"}, "maxProperties": 1024,
                   "additionalProperties": {"type": "number", "minimum": -100,
                                                              "maximum": 100}},
    "ignore_eos": {"type": "boolean"},
    "include_stop_str_in_output": {"type": "boolean"},
}

_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    },
}

_USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
    "chatserve": {"type": "object", "description": "extension: ttft_s, tokens_per_s, queue_s"}}}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def openapi_schema(model_name: str = "chatserve", vocab_size: int | None = None) -> dict:
    tid: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size:
        tid["maximum"] = vocab_size - 1
    sampling = {**_SAMPLING, "stop_token_ids": {"type": "array", "items": tid, "maxItems": 64}}
    chat_req = {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        **sampling}}
    cmpl_req = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "items": tid}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        **sampling}}
    gen_responses = {"200": {"description": "a completion object, or an SSE stream of chunks when "
                                            "stream is true",
                             "content": {"application/json": {"schema": {"type": "object"}},
                                         "text/event-stream": {"schema": {"type": "string"}}}},
                     **_errors(400, 401, 404, 413, 415, 429, 503)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "chatserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {model_name}."},
        "paths": {
            "/v1/chat/completions": {"post": {"operationId": "createChatCompletion",
                                              "requestBody": _json_body(chat_req),
                                              "responses": gen_responses}},
            "/v1/completions": {"post": {"operationId": "createCompletion",
                                         "requestBody": _json_body(cmpl_req), "responses": gen_responses}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "models", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"}, "data": {"type": "array"}}}}}},
                **_errors(401)}}},
            "/health": {"get": {"operationId": "health", "responses": {"200": {"description": "alive"}}}},
            "/ready": {"get": {"operationId": "ready", "responses": {
                "200": {"description": "ready"}, "503": {"description": "loading or draining"}}}},
            "/tokenize": {"post": {"operationId": "tokenize", "requestBody": _json_body({
                "type": "object", "properties": {
                    "prompt": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                    "add_generation_prompt": {"type": "boolean"},
                    "return_token_strs": {"type": "boolean"}}}),
                "responses": {"200": {"description": "token ids", "content": {"application/json": {
                    "schema": {"type": "object", "properties": {
                        "tokens": {"type": "array", "items": {"type": "integer"}},
                        "count": {"type": "integer"}, "max_model_len": {"type": "integer"}}}}}},
                    **_errors(400, 401, 413, 415)}}},
            "/detokenize": {"post": {"operationId": "detokenize", "requestBody": _json_body({
                "type": "object", "required": ["tokens"],
                "properties": {"tokens": {"type": "array", "items": tid}}}),
                "responses": {"200": {"description": "text", "content": {"application/json": {
                    "schema": {"type": "object", "properties": {"prompt": {"type": "string"}}}}}},
                    **_errors(400, 401, 413, 415)}}},
            "/reset_prefix_cache": {"post": {"operationId": "resetPrefixCache", "responses": {
                "200": {"description": "reset is false while running requests still hold cached blocks",
                        "content": {"application/json": {"schema": {
                            "type": "object", "required": ["reset"],
                            "properties": {"reset": {"type": "boolean"}}}}}},
                **_errors(401)}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type", "param", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": ["string", "null"]}}}}},
                "Usage": _USAGE,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
