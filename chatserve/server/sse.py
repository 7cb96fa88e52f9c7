"""Chunk dicts on the wire: SSE framing (bare-LF `data:` events, keep-alives, `[DONE]`), the grace
that lets an admission error keep its own status, and JSON that never writes NaN/Infinity.

Every SSE stream of the server goes through `sse_response`. Not the chunks themselves (chat_service.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import orjson
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from chatserve.server.errors import APIError, error_response

log = logging.getLogger("chatserve.server")
SSE_PING_SECONDS = 15.0
SSE_SEP = "\n"                # bare LF framing (`data: …\n\n`), as OpenAI and vLLM frame their streams
FIRST_CHUNK_GRACE_S = 0.05     # an admission error within this answers with its own status, not a 200 stream


def _finite_copy(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_copy(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Compact JSON that is always valid: a non-finite number (which JSON cannot represent) becomes null.
    orjson writes every chunk (it maps NaN/Infinity to null itself); the json module is the fallback
    for what orjson refuses (integers beyond 64 bits, non-str keys)."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:                    # orjson.JSONEncodeError
        pass
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        log.error("non-finite number in a response body; written as null")
        return json.dumps(_finite_copy(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class FiniteJSONResponse(JSONResponse):
    """A JSON response that never writes NaN/Infinity (nor fails on them with a 500)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


# The keep-alive is an empty event: a blank line every reader ignores. A `: ping` comment is valid SSE, but
# vLLM's benchmark client strips each network read before buffering it, so a comment that arrives alone
# loses its "\n\n" and swallows every event after it; whitespace alone survives that and the naive readers.
SSE_KEEPALIVE = b"\n\n"


def _ping_event() -> bytes:
    return SSE_KEEPALIVE


class ChunkStreamResponse(Response):
    """An SSE response over chunk dicts. An APIError raised at admission (within FIRST_CHUNK_GRACE_S)
    is answered as a plain JSON error with its status; otherwise the 200 headers and a keep-alive
    (an empty event) go out at once, so a long prefill never looks like a dead connection, and later errors
    arrive as an in-stream error event. Every event is framed with bare LF."""

    def __init__(self, chunks: AsyncGenerator[dict, None], *, send_timeout: float | None,
                 ping: float | None = None, typed: bool = False,
                 on_close: Callable[[], None] | None = None) -> None:
        self.chunks = chunks
        self.on_close = on_close         # run when the response ends, even before the first chunk
        self.typed = typed               # Responses API: `event: <type>` lines, no [DONE], typed errors
        self.send_timeout = send_timeout
        self.ping = ping
        self.background = None
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = self.chunks
        first_task = asyncio.ensure_future(chunks.__anext__())
        try:
            await asyncio.wait({first_task}, timeout=FIRST_CHUNK_GRACE_S)
            first_error = first_task.exception() if first_task.done() else None
            if isinstance(first_error, APIError):
                await error_response(first_error)(scope, receive, send)
                return

            async def events() -> AsyncIterator[Any]:
                if not first_task.done():
                    yield _ping_event()                 # flushes headers through buffering proxies
                try:
                    c = await first_task
                except StopAsyncIteration:
                    if not self.typed:
                        yield {"data": "[DONE]"}
                    return
                while True:
                    yield self._event(c)
                    if "error" in c or c.get("type") == "error":
                        break
                    try:
                        c = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                if not self.typed:
                    yield {"data": "[DONE]"}

            async def guarded() -> AsyncIterator[Any]:
                try:
                    async for e in events():
                        yield e
                except APIError as e:                   # raised after the headers went out
                    err = e.to_dict()
                    yield self._event({"type": "error", **err["error"]} if self.typed else err)
                    if not self.typed:
                        yield {"data": "[DONE]"}

            resp = EventSourceResponse(guarded(), ping=SSE_PING_SECONDS if self.ping is None else self.ping,
                                       sep=SSE_SEP,
                                       # typed as a ServerSentEvent factory; sse_starlette's ensure_bytes
                                       # passes our pre-encoded bare-LF keep-alive through unchanged
                                       ping_message_factory=_ping_event,  # type: ignore[arg-type]  # as said
                                       send_timeout=self.send_timeout,
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                await resp(scope, receive, send)
            except SendTimeoutError:       # the client stopped reading: end the stream, not an error
                log.warning("stream ended: the client did not read for %s s", self.send_timeout)
        finally:
            if not first_task.done():
                first_task.cancel()
                await asyncio.gather(first_task, return_exceptions=True)
            try:
                await chunks.aclose()      # aborts the request in the engine if it is still running
            finally:
                if self.on_close is not None:
                    self.on_close()        # a stream closed before its first step ran none of its code


    def _event(self, c: dict) -> dict:
        if self.typed:
            return {"event": c["type"], "data": dumps(c)}
        return {"data": dumps(c)}


def sse_response(chunks: AsyncGenerator[dict, None], request: Request | None = None, *,
                 typed: bool = False, on_close: Callable[[], None] | None = None) -> Response:
    """Stream chunk dicts as `data: {json}` events, `data: [DONE]` last, with keep-alive pings; every
    SSE stream of the server (chat, completions, session turns) goes through here.
    A reader that blocks a send for ServerConfig.stream_timeout is ended; a disconnect aborts.
    `on_close` runs once the response ends, however it ends (a request's model lease given back)."""
    timeout = None
    if request is not None:
        st = getattr(request.app.state, "chatserve", None)
        timeout = st.config.server.stream_timeout if st is not None else None
    return ChunkStreamResponse(chunks, send_timeout=timeout, typed=typed, on_close=on_close)
