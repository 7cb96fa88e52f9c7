"""`build_app(state)`: the Starlette application — routes, middleware, error handlers, lifespan.

Wiring only: handlers live in openai_routes.py, ws.py and the sessions module; startup of the engine
happens in the lifespan. Not the CLI (serve.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatserve.server import openai_routes, ws
from chatserve.server.auth import APIKeyMiddleware
from chatserve.server.errors import APIError, error_response
from chatserve.server.metrics import Metrics
from chatserve.server.openapi import openapi_schema
from chatserve.server.ratelimit import RateLimiter, redis_storage
from chatserve.server.redis_check import RedisCheck
from chatserve.server.state import ServerState

log = logging.getLogger("chatserve.server")


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Outermost guard: body-size limit on every route (declared and streamed), a JSON 500 instead
    of a traceback for anything unexpected, and response counting for /metrics."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.config.server.max_body_bytes
        t0 = time.perf_counter()
        started = False
        status_box = [0]

        async def _send(m: Message) -> None:
            nonlocal started
            if m["type"] == "http.response.start":
                started = True
                status_box[0] = int(m["status"])
            await send(m)

        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    await error_response(APIError(413, f"request body is over the {limit} byte limit",
                                                  code="request_too_large"))(scope, receive, _send)
                    self._count(scope, status_box[0], t0)
                    return
        seen = 0

        async def _receive() -> Message:
            nonlocal seen
            m = await receive()
            if m["type"] == "http.request":
                seen += len(m.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge()
            return m

        try:
            await self.app(scope, _receive, _send)
        except _BodyTooLarge:
            if not started:
                await error_response(APIError(413, f"request body is over the {limit} byte limit",
                                              code="request_too_large"))(scope, receive, _send)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(APIError(500, "internal server error", type="server_error",
                                              code="internal_error"))(scope, receive, _send)
        finally:
            self._count(scope, status_box[0], t0)

    def _count(self, scope: Scope, status: int, t0: float) -> None:
        if status and self.state.metrics is not None:
            route = scope.get("route")            # set by starlette's router on a match
            handler = getattr(route, "path", None) or "other"      # templates only: bounded labels
            self.state.metrics.count_response(status, handler, scope.get("method", "GET"),
                                              time.perf_counter() - t0)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = {404: f"no route {request.url.path[:200]}", 405: "method not allowed"}.get(
        exc.status_code, str(exc.detail))
    err = APIError(exc.status_code, msg, code=code)
    resp = error_response(err)
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp


async def _openapi(request: Request) -> Response:
    st: ServerState = request.app.state.chatserve
    default = st.models.peek(None)
    return JSONResponse(openapi_schema(st.model_name, default.vocab_size if default is not None else None))


def _lifespan(state: ServerState) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Startup (the default model loaded, Redis check, hooks) and shutdown (hooks, every loaded model
    drained, then the helpers closed)."""
    cfg = state.config.server

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await state.models.start()
        if state.redis_check is not None:
            await state.redis_check.start()
        for hook in state.startup_hooks:
            await hook()
        try:
            yield
        finally:
            for hook in state.shutdown_hooks:
                try:
                    await hook()
                except Exception:
                    log.exception("shutdown hook failed")
            await state.models.shutdown(cfg.drain_timeout if state.models.accepting else 0.0)
            if state.redis_check is not None:
                await state.redis_check.stop()
            if state.rate_limiter is not None:
                await state.rate_limiter.aclose()

    return lifespan


def build_app(state: ServerState, *, extra_routes: list[Any] | None = None) -> Starlette:
    cfg = state.config.server
    if state.metrics is None:
        state.metrics = Metrics(lambda: [(m.name, m.engine) for m in state.models.loaded()], state.models.info,
                                lambda: state.models.pool.kv_budget)
        metrics = state.metrics
        state.models.on_load.append(lambda m: metrics.attach(m.name, m.engine))
    if state.rate_limiter is None and (cfg.rate_limit_rpm or cfg.rate_limit_tpm):
        state.rate_limiter = RateLimiter(cfg.rate_limit_rpm, cfg.rate_limit_tpm,
                                         redis_storage(cfg.redis_url) if cfg.redis_url else None)
    if state.redis_check is None and cfg.redis_url:
        state.redis_check = RedisCheck(cfg.redis_url)

    from chatserve.server import responses
    responses.install(state)
    routes: list[Any] = [*openai_routes.routes, *responses.routes, *ws.routes,
                         Route("/openapi.json", _openapi, methods=["GET"]), *(extra_routes or [])]
    from chatserve.server.sessions import install as install_sessions
    from chatserve.server.sessions import routes as session_routes
    routes += list(session_routes)

    middleware = [Middleware(GuardMiddleware, state=state)]
    if cfg.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins),
                                     allow_methods=["GET", "POST", "PATCH", "DELETE", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"],
                                     allow_credentials=False, max_age=600))
    if cfg.api_keys:
        middleware.append(Middleware(APIKeyMiddleware, keys=tuple(cfg.api_keys)))

    app = Starlette(routes=routes, middleware=middleware, lifespan=_lifespan(state),
                    exception_handlers={APIError: _api_error, HTTPException: _http_error})
    app.state.chatserve = state
    install_sessions(app, state)
    state.freeze()
    return app
