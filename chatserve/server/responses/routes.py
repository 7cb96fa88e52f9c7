"""HTTP handlers of /v1/responses: POST (streamed or one body), GET and DELETE /v1/responses/{id}.

Thin: read and validate the body (schemas/responses.py), call the service, frame the answer. Not the logic
(service.py). `install(app, state)` gives the server its response store.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatserve.server.errors import APIError
from chatserve.server.identity import api_owner_of, rate_key_of
from chatserve.server.openai_routes import _body, _collect_unless_gone, state_of
from chatserve.server.protocol import validate
from chatserve.server.responses import service
from chatserve.server.responses.store import make_response_store
from chatserve.server.schemas.responses import ResponsesRequest
from chatserve.server.sse import sse_response
from chatserve.server.state import ServerState


async def create(request: Request) -> Response:
    st = state_of(request)
    r = validate(ResponsesRequest, await _body(request))
    p = await service.prepare(st, r, owner=api_owner_of(request), rate_key=rate_key_of(request))
    stream = service.events(st, p)
    if r.stream:       # the model lease is given back when the response ends, even if it never started
        return sse_response(stream, request, typed=True, on_close=p.chat.release)
    try:
        return await _collect_unless_gone(request, stream, service.collect, p)
    finally:
        p.chat.release()


async def _stored(request: Request) -> tuple[ServerState, str, dict]:
    st = state_of(request)
    rid = request.path_params["response_id"]
    rec = await service.store_of(st).get(api_owner_of(request), rid)
    if rec is None:
        raise APIError(404, f"no response '{rid[:200]}' is stored for this caller", param="response_id",
                       code="not_found")
    return st, rid, rec


async def retrieve(request: Request) -> Response:
    _, _, rec = await _stored(request)
    return JSONResponse(rec["response"])


async def delete(request: Request) -> Response:
    st, rid, _ = await _stored(request)
    await service.store_of(st).delete(api_owner_of(request), rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


def install(state: ServerState) -> None:
    if state.responses is None:
        state.responses = make_response_store(state.config.server.redis_url)


routes = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
]
