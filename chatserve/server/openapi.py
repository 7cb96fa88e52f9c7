"""/openapi.json (OpenAPI 3.1) built from the pydantic models in schemas/, and the static /docs page.

Every HTTP route is listed here once (the WebSocket is described in docs/api.md); the request schemas
are the models the routes validate with, so the published limits are the enforced ones.
Not validation itself (protocol.py) and not the routes.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from chatserve.server.schemas import openai as o
from chatserve.server.schemas import responses as rs
from chatserve.server.schemas import sessions as ss

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    op_id: str
    summary: str
    body: type[BaseModel] | None = None
    ok: type[BaseModel] | None = None
    ok_status: int = 200
    errors: tuple[int, ...] = (400, 401, 413, 415)
    sse: type[BaseModel] | None = None         # the event model when the route can stream
    path_params: tuple[str, ...] = ()
    query: dict[str, dict] = field(default_factory=dict)
    other_media: str | None = None             # a non-JSON 200 (text/plain, text/html)
    typed_sse: bool = False                    # `event: <type>` lines and no [DONE] (the Responses API)
    tags: tuple[str, ...] = ()


GEN_ERRORS = (400, 401, 404, 413, 415, 429, 503)
SID = ("sid",)
OPS: tuple[Op, ...] = (
    Op("post", "/v1/chat/completions", "createChatCompletion", "Chat completion (SSE with stream: true)",
       o.ChatCompletionRequest, o.ChatCompletion, errors=GEN_ERRORS, sse=o.ChatCompletionChunk, tags=("openai",)),
    Op("post", "/v1/completions", "createCompletion", "Text completion (SSE with stream: true)",
       o.CompletionRequest, o.Completion, errors=GEN_ERRORS, sse=o.Completion, tags=("openai",)),
    Op("post", "/v1/responses", "createResponse", "A response (OpenAI's Responses API; typed SSE events with "
       "stream: true)", rs.ResponsesRequest, rs.Response, errors=GEN_ERRORS, sse=rs.ResponseStreamEvent,
       typed_sse=True, tags=("openai",)),
    Op("get", "/v1/responses/{response_id}", "retrieveResponse", "A stored response (the caller's own)",
       ok=rs.Response, errors=(401, 404), path_params=("response_id",), tags=("openai",)),
    Op("delete", "/v1/responses/{response_id}", "deleteResponse", "Delete a stored response",
       ok=rs.ResponseDeleted, errors=(401, 404), path_params=("response_id",), tags=("openai",)),
    Op("get", "/v1/models", "listModels", "The served model", ok=o.ModelList, errors=(401,), tags=("openai",)),
    Op("get", "/v1/models/{model_id}", "retrieveModel", "One model by name", ok=o.Model, errors=(401, 404),
       path_params=("model_id",), tags=("openai",)),
    Op("post", "/tokenize", "tokenize", "Token ids of a prompt or of chat messages", o.TokenizeRequest,
       o.TokenizeResponse, tags=("tokens",)),
    Op("post", "/detokenize", "detokenize", "Text of token ids", o.DetokenizeRequest, o.DetokenizeResponse,
       tags=("tokens",)),
    Op("post", "/reset_prefix_cache", "resetPrefixCache", "Forget cached prefixes no request holds",
       ok=o.ResetPrefixCacheResponse, errors=(401,), tags=("operations",)),
    Op("get", "/health", "health", "Liveness", ok=o.Status, errors=(), tags=("operations",)),
    Op("get", "/ready", "ready", "Readiness (503 while loading or draining)", ok=o.Status, errors=(503,),
       tags=("operations",)),
    Op("get", "/metrics", "metrics", "Prometheus exposition format", errors=(404,), other_media="text/plain",
       tags=("operations",)),
    Op("get", "/docs", "docs", "This API, as a page", errors=(), other_media="text/html", tags=("operations",)),
    Op("get", "/openapi.json", "openapi", "This document", errors=(), other_media="application/json",
       tags=("operations",)),
    Op("get", "/", "chatUI", "The web chat UI (its files are under /static/)", errors=(),
       other_media="text/html", tags=("ui",)),
    Op("post", "/v1/sessions", "createSession", "New chat session", ss.SessionSettings, ss.Session, 201,
       errors=(400, 401, 403, 413, 415, 503), tags=("sessions",)),
    Op("get", "/v1/sessions", "listSessions", "The caller's sessions, newest first", ok=ss.SessionList,
       errors=(400, 401, 503), query={"limit": {"type": "integer", "minimum": 1, "maximum": 500}},
       tags=("sessions",)),
    Op("get", "/v1/sessions/status", "sessionStoreStatus", "The session store's state", ok=ss.StoreStatus,
       errors=(401,), tags=("sessions",)),
    Op("post", "/v1/sessions/import", "importSession", "A session from an export file", ss.SessionImport,
       ss.Session, 201, errors=(400, 401, 403, 413, 415, 503), tags=("sessions",)),
    Op("get", "/v1/sessions/{sid}", "getSession", "One session with its messages", ok=ss.Session,
       errors=(401, 404, 503), path_params=SID, tags=("sessions",)),
    Op("patch", "/v1/sessions/{sid}", "updateSession", "Title, system prompt, params or model", ss.SessionSettings,
       ss.Session, errors=(400, 401, 403, 404, 413, 415, 503), path_params=SID, tags=("sessions",)),
    Op("delete", "/v1/sessions/{sid}", "deleteSession", "Delete a session (cancels its turn)",
       ok=ss.SessionDeleted, errors=(401, 403, 404, 503), path_params=SID, tags=("sessions",)),
    Op("post", "/v1/sessions/{sid}/messages", "postSessionMessage", "One turn (SSE unless stream: false)",
       ss.TurnRequest, ss.TurnResult, errors=(400, 401, 403, 404, 409, 413, 415, 429, 503),
       sse=o.ChatCompletionChunk, path_params=SID, tags=("sessions",)),
    Op("post", "/v1/sessions/{sid}/attach", "attachSessionTurn", "Follow the running turn (SSE): its text so "
       "far, then the live stream", ss.AttachRequest, errors=(400, 401, 403, 404, 503), sse=o.ChatCompletionChunk,
       path_params=SID, tags=("sessions",)),
    Op("post", "/v1/sessions/{sid}/branch", "switchSessionBranch", "Make a message version active",
       ss.BranchRequest, ss.Session, errors=(400, 401, 403, 404, 409, 413, 415, 503), path_params=SID,
       tags=("sessions",)),
    Op("post", "/v1/sessions/{sid}/cancel", "cancelSessionTurn", "Stop the running turn",
       ok=ss.TurnCancelled, errors=(401, 403), path_params=SID, tags=("sessions",)),
    Op("get", "/v1/sessions/{sid}/export", "exportSession", "The session as a file", ok=ss.SessionExport,
       errors=(401, 404, 503), path_params=SID, tags=("sessions",)),
)


Mode = Literal["validation", "serialization"]


def _models() -> list[tuple[type[BaseModel], Mode]]:
    out: list[tuple[type[BaseModel], Mode]] = [(o.ErrorResponse, "serialization")]
    for op in OPS:
        if op.body is not None:
            out.append((op.body, "validation"))
        for m in (op.ok, op.sse):
            if m is not None:
                out.append((m, "serialization"))
    return list(dict.fromkeys(out))             # in order, each once


@lru_cache(maxsize=1)
def _components() -> tuple[dict, dict]:
    keys, top = models_json_schema(_models(), ref_template=REF)
    return {k: v["$ref"] for k, v in keys.items()}, top.get("$defs", {})


def _set_token_id_max(node: Any, vocab_size: int) -> None:
    """Token ids are published with the served vocabulary's bound (the fuzzer then sends valid ones)."""
    if isinstance(node, dict):
        if node.get("x-token-id"):
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _set_token_id_max(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _set_token_id_max(v, vocab_size)


def _ref(refs: dict, model: type[BaseModel], mode: str) -> dict:
    return {"$ref": refs[(model, mode)]}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _operation(op: Op, refs: dict) -> dict:
    out: dict[str, Any] = {"operationId": op.op_id, "summary": op.summary, "tags": list(op.tags)}
    params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
              for p in op.path_params]
    params += [{"name": k, "in": "query", "required": False, "schema": v} for k, v in op.query.items()]
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": _json(_ref(refs, op.body, "validation"))}
    ok: dict[str, Any] = {"description": op.summary}
    content: dict[str, Any] = {}
    if op.ok is not None:
        content.update(_json(_ref(refs, op.ok, "serialization")))
    if op.sse is not None:
        framing = ("`event: <type>` and `data: {json}` lines framed with bare LF, empty keep-alive events, "
                   "no [DONE]" if op.typed_sse else "`data: {json}` events framed with bare LF, empty "
                   "keep-alive events, `data: [DONE]` last")
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": framing + "; each event's JSON is an " + op.sse.__name__},
            "x-event-schema": _ref(refs, op.sse, "serialization")}
    if op.other_media:
        content[op.other_media] = {"schema": {"type": "object"} if op.other_media.endswith("json")
                                   else {"type": "string"}}
    if content:
        ok["content"] = content
    err = {"description": "error", "content": _json(_ref(refs, o.ErrorResponse, "serialization"))}
    out["responses"] = {str(op.ok_status): ok, **{str(c): err for c in op.errors}}
    return out


def openapi_schema(model_name: str = "chatserve", vocab_size: int | None = None) -> dict:
    refs, defs = _components()
    paths: dict[str, dict] = {}
    for op in OPS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "chatserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {model_name}, plus chat sessions. "
                                "The WebSocket /v1/ws is described in docs/api.md."},
        "paths": paths,
        "components": {"schemas": json.loads(json.dumps(defs)),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }
    if vocab_size:
        _set_token_id_max(spec["components"], vocab_size)
    return spec


def docs_page() -> str:
    """A self-contained HTML page listing every route with its request fields (no scripts, no CDN)."""
    refs, defs = _components()
    rows = []
    for op in OPS:
        fields = ""
        if op.body is not None:
            props = defs[refs[(op.body, "validation")].rsplit("/", 1)[1]].get("properties", {})
            fields = ", ".join(f"<code>{html.escape(k)}</code>" for k in props)
        rows.append(f"<tr><td><b>{op.method.upper()}</b></td><td><code>{html.escape(op.path)}</code></td>"
                    f"<td>{html.escape(op.summary)}</td><td>{fields}</td></tr>")
    return ("<!doctype html><html><head><meta charset=utf-8><title>chatserve API</title><style>"
            "body{font:14px system-ui,sans-serif;margin:2em}td{border-top:1px solid #ddd;padding:4px 8px;"
            "vertical-align:top}code{background:#f4f4f4}</style></head><body><h1>chatserve API</h1>"
            "<p>The full schema: <a href=\"/openapi.json\">/openapi.json</a> (OpenAPI 3.1). Field "
            "status: docs/api.md.</p><table><tr><th>method</th><th>path</th><th>what</th>"
            "<th>request fields</th></tr>" + "".join(rows) + "</table></body></html>")
