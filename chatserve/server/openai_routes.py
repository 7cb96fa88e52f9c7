"""HTTP handlers for the OpenAI-compatible API and the operational endpoints.

/v1/chat/completions, /v1/completions, /v1/models, /v1/models/{id}, /health, /ready, /tokenize,
/detokenize, /metrics, /reset_prefix_cache, /openapi.json and /docs.
Not the WebSocket (ws.py), not sessions (session_routes.py), not the app wiring (app.py).
"""
from __future__ import annotations

import asyncio
from typing import AsyncGenerator

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from chatserve.engine.model_pool import ModelInfo
from chatserve.reasoning.select import template_has_thinking_switch
from chatserve.server.body import read_json_object
from chatserve.server.chat_service import stream_chat, stream_completion
from chatserve.server.collect import collect_chat, collect_completion
from chatserve.server.errors import APIError, invalid
from chatserve.server.identity import api_owner_of, rate_key_of
from chatserve.server.metrics import CONTENT_TYPE
from chatserve.server.openapi import docs_page
from chatserve.server.admission import admit, check_text_size, requested_model
from chatserve.server.protocol import (check_token_ids, normalize_messages, parse_chat_body,
                                       parse_completion_body, render_prompt, template_options, validate)
from chatserve.server.schemas import openai as s
from chatserve.server.sse import FiniteJSONResponse, sse_response
from chatserve.server.state import ServerState


def state_of(request: Request) -> ServerState:
    return request.app.state.chatserve


async def _body(request: Request) -> dict:
    st = state_of(request)
    return await read_json_object(request, st.config.server.max_body_bytes)


async def _drop_usage(chunks: AsyncGenerator[dict, None]) -> AsyncGenerator[dict, None]:
    """Without stream_options.include_usage, clients get no usage chunk (as OpenAI)."""
    try:
        async for c in chunks:
            if c.get("usage") is not None and not c.get("choices"):
                continue
            yield c
    finally:
        await chunks.aclose()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(request: Request, chunks: AsyncGenerator[dict, None], collect, req) -> Response:
    """A non-streaming answer; if the client hangs up first, the generation is aborted."""
    work = asyncio.ensure_future(collect(chunks, req))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return FiniteJSONResponse(work.result())
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=499)          # nobody is listening any more
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        await chunks.aclose()


async def _generation(request: Request, parse, stream, collect) -> Response:
    """Parse the body, then stream SSE chunks or answer once with the folded chunks."""
    st = state_of(request)
    req = await admit(st, await _body(request), parse, rate_key=rate_key_of(request))
    # the model lease is given back on every exit: once the engine has the request (the stream does
    # it), or when the response ends, whether or not the stream ever started
    chunks = stream(st, req, owner=api_owner_of(request), rate_key=rate_key_of(request))
    if req.stream:
        return sse_response(chunks if req.include_usage else _drop_usage(chunks), request, on_close=req.release)
    try:
        return await _collect_unless_gone(request, chunks, collect, req)
    finally:
        req.release()


async def chat_completions(request: Request) -> Response:
    return await _generation(request, parse_chat_body, stream_chat, collect_chat)


async def completions(request: Request) -> Response:
    return await _generation(request, parse_completion_body, stream_completion, collect_completion)


def _model_card(st: ServerState, info: ModelInfo) -> dict:
    """A configured model as /v1/models lists it; what only a loaded model knows (its context, defaults,
    template) is filled in while it is loaded."""
    spec = st.models.spec(info.name)
    card: dict = {"id": info.name, "object": "model", "created": int(st.started_at), "owned_by": "chatserve",
                  "root": spec.config.model.model or info.name, "parent": None, "status": info.phase,
                  "size_bytes": info.size}
    served = st.models.pool.peek(info.name)
    if served is not None:
        card.update({"max_model_len": served.max_model_len, "max_tokens_default": served.default_max_tokens,
                     # the model's recommended sampling (--generation-config), for clients that show defaults
                     "sampling_defaults": {k: v for k, v in served.sampling_defaults.items() if k != "max_tokens"},
                     "thinking_switch": template_has_thinking_switch(served.chat_template)})
    return card


async def models(request: Request) -> Response:
    """Every configured model, loaded or not (status says which)."""
    st = state_of(request)
    return JSONResponse({"object": "list", "data": [_model_card(st, i) for i in st.models.info()]})


async def model(request: Request) -> Response:
    """GET /v1/models/{id} (the SDKs' models.retrieve); any served name (aliases too) answers."""
    st = state_of(request)
    mid = request.path_params["model_id"]
    name = st.models.resolve(mid)                     # 404 listing the names
    info = next(i for i in st.models.info() if i.name == name)
    return JSONResponse({**_model_card(st, info), "id": mid})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    st = state_of(request)
    if st.models.ready:
        # Redis down or refusing our password: still serving (sessions kept in process, rate limits
        # per process), so 200, but the body says what is degraded and why (no host or password).
        if st.redis_check is not None and not st.redis_check.ok:
            return JSONResponse({"status": "degraded", "model": st.model_name, **st.redis_check.ready_info()})
        return JSONResponse({"status": "ready", "model": st.model_name})
    why = "draining" if not st.models.accepting else "loading"
    return JSONResponse({"status": why}, status_code=503, headers={"Retry-After": "5"})


async def tokenize(request: Request) -> Response:
    st = state_of(request)
    body = await _body(request)
    name, keep_alive = requested_model(body)
    lease = await st.models.lease(name, keep_alive)
    try:
        served = lease.value
        check_text_size(served, body)
        r = validate(s.TokenizeRequest, body)
        if r.messages is not None:
            msgs = normalize_messages(r.messages)
            ids = await asyncio.to_thread(render_prompt, served, msgs, template_options(r))
        elif r.prompt is not None:
            extra = {"add_special_tokens": True} if r.add_special_tokens else {}
            ids = await asyncio.to_thread(served.tokenizer.encode, r.prompt, **extra)
        else:
            raise invalid("send 'prompt' (a string) or 'messages'", "prompt", "missing_required_parameter")
        ids = list(ids)
        out = {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}
        if r.return_token_strs:
            out["token_strs"] = [served.tokenizer.token_str(i) for i in ids]
    finally:
        lease.release()
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    st = state_of(request)
    body = await _body(request)
    r = validate(s.DetokenizeRequest, body)
    lease = await st.models.lease(*requested_model(body))
    try:
        ids = check_token_ids(r.tokens, "tokens", lease.value.vocab_size)
        text = await asyncio.to_thread(lease.value.tokenizer.decode, ids)
    finally:
        lease.release()
    return JSONResponse({"prompt": text})


async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prefix no running request holds in every loaded model ({"reset": false} while
    some do)."""
    st = state_of(request)
    results = [m.engine.reset_prefix_cache() for m in st.models.loaded()]
    return JSONResponse({"reset": all(results)})


async def metrics(request: Request) -> Response:
    st = state_of(request)
    if st.metrics is None:
        raise APIError(404, "metrics are disabled", code="not_found")
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


async def docs(request: Request) -> Response:
    return HTMLResponse(docs_page(), headers={"Content-Security-Policy": DOCS_CSP})


DOCS_CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; frame-ancestors 'none'"

routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    Route("/docs", docs, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
]
