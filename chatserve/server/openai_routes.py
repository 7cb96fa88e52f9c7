"""HTTP handlers for the OpenAI-compatible API and the operational endpoints.

/v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /tokenize, /detokenize, /metrics,
/reset_prefix_cache.
Not the WebSocket (ws.py), not sessions (session_routes.py), not the app wiring (app.py).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatserve.server.body import read_json_object
from chatserve.server.chat_service import (collect_chat, collect_completion, precheck, sse_response,
                                           stream_chat, stream_completion)
from chatserve.server.errors import APIError, invalid
from chatserve.server.identity import api_owner_of, rate_key_of
from chatserve.server.metrics import CONTENT_TYPE
from chatserve.server.prompt_guard import admit, check_text_size
from chatserve.server.protocol import (get_bool, normalize_messages, parse_chat_body,
                                       parse_completion_body, parse_token_ids)
from chatserve.server.state import ServerState


def state_of(request: Request) -> ServerState:
    return request.app.state.chatserve


async def _body(request: Request) -> dict:
    st = state_of(request)
    return await read_json_object(request, st.config.server.max_body_bytes)


async def _generation_body(request: Request) -> dict:
    body = await _body(request)
    precheck(state_of(request))          # overloaded: refuse before tokenizing
    return body


async def _drop_usage(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
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


async def _collect_unless_gone(request: Request, chunks: AsyncIterator[dict], collect, n: int) -> Response:
    """A non-streaming answer; if the client hangs up first, the generation is aborted."""
    work = asyncio.ensure_future(collect(chunks, n))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return JSONResponse(work.result())
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
    req = await admit(st, await _generation_body(request), parse, rate_key=rate_key_of(request))
    chunks = stream(st, req, owner=api_owner_of(request), rate_key=rate_key_of(request))
    if req.stream:
        return sse_response(chunks if req.include_usage else _drop_usage(chunks), request)
    return await _collect_unless_gone(request, chunks, collect, req.params.n)


async def chat_completions(request: Request) -> Response:
    return await _generation(request, parse_chat_body, stream_chat, collect_chat)


async def completions(request: Request) -> Response:
    return await _generation(request, parse_completion_body, stream_completion, collect_completion)


async def models(request: Request) -> Response:
    st = state_of(request)
    return JSONResponse({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": int(st.started_at), "owned_by": "chatserve",
        "root": st.config.model.model or st.model_name, "parent": None,
        "max_model_len": st.max_model_len}]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    st = state_of(request)
    if getattr(st.engine, "ready", False):
        # Redis down or refusing our password: still serving (sessions kept in process, rate limits
        # per process), so 200, but the body says what is degraded and why (no host or password).
        if st.redis_check is not None and not st.redis_check.ok:
            return JSONResponse({"status": "degraded", "model": st.model_name, **st.redis_check.ready_info()})
        return JSONResponse({"status": "ready", "model": st.model_name})
    why = "draining" if not getattr(st.engine, "accepting", True) else "loading"
    return JSONResponse({"status": why}, status_code=503, headers={"Retry-After": "5"})


async def tokenize(request: Request) -> Response:
    st = state_of(request)
    body = await _body(request)
    check_text_size(st, body)
    if "messages" in body:
        msgs = normalize_messages(body["messages"])
        try:
            ids = await asyncio.to_thread(st.tokenizer.apply_chat_template, msgs,
                                          add_generation_prompt=get_bool(body, "add_generation_prompt", True))
        except Exception as e:       # template errors are the messages' fault
            raise invalid(f"invalid messages: {e}"[:500], "messages") from None
    elif isinstance(body.get("prompt"), str):
        ids = await asyncio.to_thread(st.tokenizer.encode, body["prompt"])
    else:
        raise invalid("send 'prompt' (a string) or 'messages'", "prompt", "missing_required_parameter")
    ids = list(ids)
    out = {"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len}
    if get_bool(body, "return_token_strs"):
        out["token_strs"] = [st.tokenizer.token_str(i) for i in ids]
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    st = state_of(request)
    body = await _body(request)
    if "tokens" not in body:
        raise invalid("'tokens' is required", "tokens", "missing_required_parameter")
    ids = parse_token_ids(body["tokens"], "tokens", st.vocab_size)
    text = await asyncio.to_thread(st.tokenizer.decode, ids)
    return JSONResponse({"prompt": text})


async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prefix no running request holds ({"reset": false} while some do)."""
    st = state_of(request)
    reset = getattr(st.engine, "reset_prefix_cache", None)
    return JSONResponse({"reset": bool(reset()) if reset is not None else False})


async def metrics(request: Request) -> Response:
    st = state_of(request)
    if st.metrics is None:
        raise APIError(404, "metrics are disabled", code="not_found")
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
]
