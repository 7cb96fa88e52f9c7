"""HTTP routes for chat sessions, the web UI's pages, the browser edge middleware, and the
"session" message type of the /v1/ws WebSocket.

A turn appends the user message, generates from the stored history through chat_service.stream_chat
(keep_warm=True) and stores the reply with its usage. The store lives in sessions.py; the OpenAI
routes, the WebSocket itself and the engine are elsewhere.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Protocol
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from chatserve.server.errors import APIError, error_response
from chatserve.server.identity import COOKIE_NAME, owner_of, rate_key_of
from chatserve.server.sessions import (Session, SessionStore, StoreUnavailable, make_session_store,
                                       new_session_id, valid_session_id)

log = logging.getLogger("chatserve.sessions")

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
COOKIE = COOKIE_NAME
COOKIE_RE = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
                 "seed": int, "repetition_penalty": float, "presence_penalty": float,
                 "frequency_penalty": float, "stop": list}
USAGE_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "tokens_per_s", "queue_s")
MAX_CONTENT_CHARS = 200_000
MAX_TITLE_CHARS = 200
MAX_IMPORT_MESSAGES = 5_000
ROLES = ("user", "assistant", "system")
EXPORT_FORMAT = "chatserve.session.v1"
WS_MESSAGE_TYPE = "session"


# ── the chat backend: chat_service by default; tests may put another on app.state ───────────────
class ChatBackend(Protocol):
    def parse(self, body: dict, state: Any) -> Any: ...
    def stream(self, state: Any, req: Any, *, owner: str, keep_warm: bool, request_id: str | None,
               rate_key: str | None = None) -> AsyncIterator[dict]: ...


class _ChatService:
    """Adapter over chatserve.server.chat_service (imported on first use)."""

    def parse(self, body: dict, state: Any) -> Any:
        from chatserve.server import chat_service
        return chat_service.parse_chat_body(body, state)

    def stream(self, state: Any, req: Any, *, owner: str, keep_warm: bool, request_id: str | None,
               rate_key: str | None = None) -> AsyncIterator[dict]:
        from chatserve.server import chat_service
        return chat_service.stream_chat(state, req, owner=owner, keep_warm=keep_warm,
                                        request_id=request_id, rate_key=rate_key)


_DEFAULT_BACKEND = _ChatService()


@dataclass
class Turn:
    """One generation in one session; at most one per session in this process."""

    session_id: str
    owner: str
    task: asyncio.Task | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None and not self.task.done():
            self.task.cancel()


@dataclass
class TurnRegistry:
    by_session: dict[str, Turn] = field(default_factory=dict)
    background: set = field(default_factory=set)       # reply-saving tasks still running


@dataclass
class Ctx:
    """What a turn needs; reachable from an HTTP request and from the /v1/ws handler alike."""

    app_state: Any                  # starlette's app.state
    state: Any                      # ServerState

    @property
    def store(self) -> SessionStore:
        st = getattr(self.state, "sessions", None)
        return st if st is not None else self.app_state.session_store

    @property
    def backend(self) -> ChatBackend:
        """Test hook: `app.state.session_chat_backend = obj` stands in for the model (docs/sessions.md)."""
        return getattr(self.app_state, "session_chat_backend", None) or _DEFAULT_BACKEND

    @property
    def turns(self) -> TurnRegistry:
        reg = getattr(self.app_state, "session_turns", None)
        if reg is None:
            reg = self.app_state.session_turns = TurnRegistry()
        return reg


def _ctx(conn: HTTPConnection) -> Ctx:
    return Ctx(conn.app.state, conn.app.state.chatserve)


def _not_found() -> APIError:
    return APIError(404, "session not found", code="session_not_found")


def _unavailable(e: StoreUnavailable) -> APIError:
    return APIError(503, str(e), code="session_store_unavailable", retry_after=2)


def _same_origin(conn: HTTPConnection) -> bool:
    """Requests that carry an Origin must come from this host (or a configured CORS origin)."""
    origin = conn.headers.get("origin")
    if not origin:
        return True
    if urlsplit(origin).netloc == conn.headers.get("host", ""):
        return True
    cfg = getattr(getattr(conn.app.state.chatserve, "config", None), "server", None)
    return origin in tuple(getattr(cfg, "cors_origins", ()) or ())


def _check_origin(conn: HTTPConnection) -> None:
    if not _same_origin(conn):
        raise APIError(403, "cross-origin request refused", code="cross_origin")


async def _json_body(request: Request) -> dict:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":      # forces a CORS preflight on cross-origin writers
        raise APIError(415, "Content-Type must be application/json", code="unsupported_media_type")
    _check_origin(request)
    try:
        body = json.loads(await request.body() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "body must be a JSON object", code="invalid_json")
    return body


def _store_header(store: SessionStore) -> dict[str, str]:
    st = store.status()
    return {"X-Chatserve-Session-Store": "memory" if not st["persistent"]
            else ("degraded" if st["degraded"] else "ok")}


def _respond(store: SessionStore, content: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status, headers=_store_header(store))


def handles_errors(fn: Any) -> Any:
    """Route decorator: APIError and StoreUnavailable become their JSON error responses."""
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return error_response(e)
        except StoreUnavailable as e:
            return error_response(_unavailable(e))
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


# ── validation of what users may set ────────────────────────────────────────────────────────
def _clean_params(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise APIError(400, "params must be an object", param="params")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in SAMPLING_KEYS:
            raise APIError(400, f"unknown sampling parameter {k[:40]!r}", param="params")
        if v is None:
            continue
        want = SAMPLING_KEYS[k]
        if want is list:
            if isinstance(v, str):
                v = [v]
            if not (isinstance(v, list) and len(v) <= 4 and all(isinstance(x, str) for x in v)):
                raise APIError(400, "stop must be a string or a list of up to 4 strings", param="stop")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and v != int(v)):
            raise APIError(400, f"{k} must be a number", param=k)
        else:
            v = want(v)
        out[k] = v
    return out


def _clean_text(v: Any, name: str, limit: int) -> str:
    if not isinstance(v, str):
        raise APIError(400, f"{name} must be a string", param=name)
    if len(v) > limit:
        raise APIError(400, f"{name} is longer than {limit} characters", param=name)
    return v


def _apply_settings(s: Session, body: dict) -> None:
    if "title" in body:
        s.title = _clean_text(body["title"], "title", MAX_TITLE_CHARS).strip() or "New chat"
    if "system_prompt" in body:
        s.system_prompt = _clean_text(body["system_prompt"] or "", "system_prompt", MAX_CONTENT_CHARS)
    if "params" in body:
        s.params = _clean_params(body["params"])
    if "model" in body:
        s.model = None if body["model"] is None else _clean_text(body["model"], "model", 200)


def _clean_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or len(raw) > MAX_IMPORT_MESSAGES:
        raise APIError(400, f"messages must be a list of at most {MAX_IMPORT_MESSAGES}", param="messages")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, "each message needs a role: user, assistant or system", param="messages")
        created = m.get("created")
        msg: dict[str, Any] = {
            "role": m["role"], "content": _clean_text(m.get("content", ""), "content", MAX_CONTENT_CHARS),
            "created": float(created) if isinstance(created, (int, float)) and not isinstance(created, bool)
            else time.time()}
        if m["role"] == "assistant" and isinstance(m.get("usage"), dict):
            msg["usage"] = {k: v for k, v in m["usage"].items()
                            if k in USAGE_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if isinstance(m.get("finish_reason"), str):
            msg["finish_reason"] = m["finish_reason"][:20]
        out.append(msg)
    return out


# ── REST: sessions ──────────────────────────────────────────────────────────────────────────
@handles_errors
async def create_session(request: Request) -> Response:
    body = await _json_body(request)
    s = Session(id=new_session_id(), owner=owner_of(request))
    _apply_settings(s, body)
    store = _ctx(request).store
    return _respond(store, (await store.create(s)).public(), 201)


@handles_errors
async def list_sessions(request: Request) -> Response:
    try:
        limit = max(1, min(500, int(request.query_params.get("limit", "100"))))
    except ValueError:
        raise APIError(400, "limit must be an integer", param="limit") from None
    store = _ctx(request).store
    items = await store.list(owner_of(request), limit)
    return _respond(store, {"object": "list", "data": [s.summary() for s in items], "store": store.status()})


async def store_status(request: Request) -> Response:
    store = _ctx(request).store
    return _respond(store, store.status())


async def _get_own(request: Request) -> tuple[SessionStore, Session]:
    sid = request.path_params["sid"]
    store = _ctx(request).store
    s = await store.get(owner_of(request), sid) if valid_session_id(sid) else None
    if s is None:
        raise _not_found()
    return store, s


@handles_errors
async def get_session(request: Request) -> Response:
    store, s = await _get_own(request)
    out = s.public()
    out["generating"] = s.id in _ctx(request).turns.by_session
    return _respond(store, out)


@handles_errors
async def patch_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    body = await _json_body(request)
    _apply_settings(Session(id="x" * 22, owner=""), body)           # validate before touching it
    store = _ctx(request).store
    s = (await store.update(owner_of(request), sid, lambda s: _apply_settings(s, body))
         if valid_session_id(sid) else None)
    if s is None:
        raise _not_found()
    return _respond(store, s.public())


@handles_errors
async def delete_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    _check_origin(request)
    ctx = _ctx(request)
    if not (valid_session_id(sid) and await ctx.store.delete(owner_of(request), sid)):
        raise _not_found()
    turn = ctx.turns.by_session.get(sid)
    if turn is not None:
        turn.cancel()
    return _respond(ctx.store, {"id": sid, "object": "session", "deleted": True})


@handles_errors
async def export_session(request: Request) -> Response:
    _, s = await _get_own(request)
    doc = {"format": EXPORT_FORMAT, "title": s.title, "created": s.created, "updated": s.updated,
           "model": s.model, "system_prompt": s.system_prompt, "params": s.params, "messages": s.messages}
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", s.title)[:40].strip("-") or "chat"
    return JSONResponse(doc, headers={"Content-Disposition": f'attachment; filename="{safe}.json"'})


@handles_errors
async def import_session(request: Request) -> Response:
    body = await _json_body(request)
    if body.get("format", EXPORT_FORMAT) != EXPORT_FORMAT:
        raise APIError(400, f"unknown format; expected {EXPORT_FORMAT}", param="format")
    s = Session(id=new_session_id(), owner=owner_of(request))
    _apply_settings(s, {k: body[k] for k in ("title", "system_prompt", "params", "model") if k in body})
    s.messages = _clean_messages(body.get("messages", []))
    store = _ctx(request).store
    return _respond(store, (await store.create(s)).public(), 201)


# ── turns ───────────────────────────────────────────────────────────────────────────────────
@dataclass
class PreparedTurn:
    session: Session
    chat_request: Any
    turn: Turn


async def prepare_turn(ctx: Ctx, owner: str, sid: str, body: dict) -> PreparedTurn:
    """Validate, store the user's message, and build the chat request from the stored history.

    body: {"content"?, "replace_from"?: index (edit and resend), "regenerate"?: bool, ...sampling}.
    """
    content = body.get("content")
    if content is not None:
        content = _clean_text(content, "content", MAX_CONTENT_CHARS)
    replace_from = body.get("replace_from")
    if replace_from is not None and (isinstance(replace_from, bool) or not isinstance(replace_from, int)
                                     or replace_from < 0):
        raise APIError(400, "replace_from must be a message index", param="replace_from")
    regenerate = bool(body.get("regenerate"))
    overrides = _clean_params({k: v for k, v in body.items() if k in SAMPLING_KEYS})
    if content is None and replace_from is None and not regenerate:
        raise APIError(400, "content is required", param="content", code="missing_required_parameter")
    if not valid_session_id(sid):
        raise _not_found()
    reg, store = ctx.turns, ctx.store
    if sid in reg.by_session:
        raise APIError(409, "a reply is already being generated in this session", code="session_busy")
    turn = Turn(session_id=sid, owner=owner)
    reg.by_session[sid] = turn                       # claimed before any await
    try:
        def add_user(s: Session) -> None:
            msgs = s.messages
            if replace_from is not None:
                if replace_from > len(msgs):
                    raise APIError(400, "replace_from is past the end of the conversation",
                                   param="replace_from")
                del msgs[replace_from:]
            elif regenerate:
                while msgs and msgs[-1]["role"] == "assistant":
                    msgs.pop()
            if content is not None:
                msgs.append({"role": "user", "content": content, "created": time.time()})
                if s.title == "New chat" and sum(m["role"] == "user" for m in msgs) == 1:
                    s.title = " ".join(content.split())[:60] or "New chat"
            if not msgs or msgs[-1]["role"] != "user":
                raise APIError(400, "nothing to answer: the conversation must end with a user message")

        # validate against a preview first, so a rejected request leaves the session untouched
        cur = await store.get(owner, sid)
        if cur is None:
            raise _not_found()
        add_user(cur)
        req = _parse_turn(ctx, cur, overrides)
        s = await store.update(owner, sid, add_user)
        if s is None:
            raise _not_found()

        def key(x: Session) -> tuple:
            return [(m["role"], m["content"]) for m in x.messages], x.params, x.system_prompt, x.model

        if key(s) != key(cur):
            req = _parse_turn(ctx, s, overrides)          # it changed meanwhile (another process)
        return PreparedTurn(session=s, chat_request=req, turn=turn)
    except BaseException:
        reg.by_session.pop(sid, None)
        raise


def _parse_turn(ctx: Ctx, s: Session, overrides: dict) -> Any:
    chat: dict[str, Any] = {
        "model": s.model or getattr(ctx.state, "model_name", None) or "default",
        "messages": ([{"role": "system", "content": s.system_prompt}] if s.system_prompt else [])
        + [{"role": m["role"], "content": m["content"]} for m in s.messages],
        "stream": True, "stream_options": {"include_usage": True},
        **s.params, **overrides}
    return ctx.backend.parse(chat, ctx.state)


async def run_turn(ctx: Ctx, p: PreparedTurn, rate_key: str | None = None) -> AsyncIterator[dict]:
    """Stream the reply's chunks; store the reply (a partial one too, on Stop or disconnect) at the end.

    The model is driven by a pump task, so that Turn.cancel() from another request (Stop) ends it at
    once; stream_chat sees the cancellation and aborts the engine request. An APIError raised before
    the first chunk (overload, rate limit, context too long) propagates to the caller.
    """
    reg, store, backend, turn, sid = ctx.turns, ctx.store, ctx.backend, p.turn, p.session.id
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump() -> None:
        agen = backend.stream(ctx.state, p.chat_request, owner=turn.owner, keep_warm=True,
                              request_id=f"sess-{sid[:8]}-{secrets.token_hex(4)}", rate_key=rate_key)
        try:
            async for chunk in agen:
                queue.put_nowait(chunk)
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()

    t0 = time.perf_counter()
    text: list[str] = []
    finish: str | None = None
    usage: dict[str, Any] | None = None
    first_token_at: float | None = None
    n_chunks = n_content = 0
    error: str | None = None
    early_error: BaseException | None = None
    task = asyncio.get_running_loop().create_task(pump())
    task.add_done_callback(lambda _t: queue.put_nowait(done))
    turn.task = task
    try:
        while True:
            item = await queue.get()
            if item is done:
                break
            n_chunks += 1
            for ch in item.get("choices") or []:
                delta = ch.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                    n_content += 1
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
            if item.get("usage"):
                usage = item["usage"]
            if item.get("error"):
                error = str((item["error"] or {}).get("message") or "generation failed")
                finish = "error"
            yield item
        if task.cancelled() or turn.cancelled:
            finish = "abort"
            yield {"id": f"chatcmpl-{sid[:12]}", "object": "chat.completion.chunk",
                   "created": int(time.time()), "model": p.session.model or "",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}
        elif task.exception() is not None:
            exc = task.exception()
            if n_chunks == 0 and isinstance(exc, APIError):
                early_error = exc
            else:
                error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                log.warning("session %s: generation failed: %s", sid, error)
                finish = "error"
                yield {"error": {"message": error, "type": "server_error", "param": None,
                                 "code": "generation_failed"}}
    finally:
        if not task.done():                   # the client went away: abort the generation
            turn.cancelled = True
            task.cancel()
        reply = "".join(text)
        msg: dict[str, Any] = {
            "role": "assistant", "content": reply, "created": time.time(),
            "finish_reason": finish or ("abort" if turn.cancelled else "stop"),
            "usage": _usage_record(usage, t0, first_token_at, n_content)}
        if error:
            msg["error"] = error[:500]
        keep = early_error is None and (reply or not error)

        async def save() -> None:
            try:
                if keep:
                    await store.update(turn.owner, sid, lambda s: s.messages.append(msg))
            except Exception as e:             # StoreUnavailable: the reply was streamed but not kept
                log.error("session %s: reply not stored: %s", sid, e)
            finally:
                if reg.by_session.get(sid) is turn:
                    del reg.by_session[sid]

        bg = asyncio.get_running_loop().create_task(save())
        reg.background.add(bg)
        bg.add_done_callback(reg.background.discard)
        await asyncio.shield(bg)
    if early_error is not None:
        raise early_error


def _usage_record(usage: dict | None, t0: float, first: float | None, n_content: int) -> dict:
    now = time.perf_counter()
    u: dict[str, Any] = {}
    if usage:
        u["prompt_tokens"] = usage.get("prompt_tokens")
        u["completion_tokens"] = usage.get("completion_tokens")
        u["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        extra = usage.get("chatserve") or {}
        for k in ("ttft_s", "tokens_per_s", "queue_s"):
            if extra.get(k) is not None:
                u[k] = extra[k]
    if u.get("completion_tokens") is None:
        u["completion_tokens"] = n_content          # stopped early: no usage chunk came
    if "ttft_s" not in u and first is not None:
        u["ttft_s"] = round(first - t0, 4)
    if "tokens_per_s" not in u and first is not None and now > first and u["completion_tokens"] > 1:
        u["tokens_per_s"] = round((u["completion_tokens"] - 1) / (now - first), 2)
    return {k: v for k, v in u.items() if v is not None}


@handles_errors
async def post_message(request: Request) -> Response:
    """POST /v1/sessions/{id}/messages: one turn, streamed as SSE chunks (or JSON with stream=false)."""
    sid = request.path_params["sid"]
    body = await _json_body(request)
    ctx = _ctx(request)
    p = await prepare_turn(ctx, owner_of(request), sid, body)
    chunks = run_turn(ctx, p, rate_key_of(request))
    if body.get("stream", True) is False:
        async for _chunk in chunks:
            pass
        s = await ctx.store.get(p.turn.owner, sid)
        return _respond(ctx.store, {"session_id": sid, "index": len(s.messages) - 1 if s else None,
                                    "message": s.messages[-1] if s and s.messages else None})
    from chatserve.server.chat_service import sse_response
    resp = sse_response(chunks, request)
    return resp


@handles_errors
async def cancel_turn(request: Request) -> Response:
    """POST /v1/sessions/{id}/cancel: Stop. The stream ends with finish_reason "abort"."""
    sid = request.path_params["sid"]
    _check_origin(request)
    turn = _ctx(request).turns.by_session.get(sid)
    if turn is None or turn.owner != owner_of(request):
        return JSONResponse({"id": sid, "cancelled": False})
    turn.cancel()
    return JSONResponse({"id": sid, "cancelled": True})


def ws_session_handler(app_state: Any) -> Any:
    """The /v1/ws extension: {"id", "type": "session", "session_id", "content", ...} streams one turn;
    {"type": "cancel", "id"} (handled by ws.py) cancels the task, which aborts and stores the partial."""
    async def handler(state: Any, body: dict, owner: str, request_id: str) -> AsyncIterator[dict]:
        ctx = Ctx(app_state, state)
        try:
            p = await prepare_turn(ctx, owner, str(body.get("session_id", "")), body)
        except StoreUnavailable as e:
            raise _unavailable(e) from None
        chunks = run_turn(ctx, p)
        try:
            async for chunk in chunks:
                yield chunk
        finally:                     # closed at once (not at GC): abort, free the KV, save the partial
            await chunks.aclose()
    return handler


# ── the UI ──────────────────────────────────────────────────────────────────────────────────
async def ui_index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


class _StaticFiles(StaticFiles):
    def file_response(self, *a: Any, **kw: Any) -> Response:
        resp = super().file_response(*a, **kw)
        resp.headers["Cache-Control"] = "no-cache"
        return resp


routes = [
    Route("/", ui_index, methods=["GET", "HEAD"]),
    Mount("/static", app=_StaticFiles(directory=STATIC_DIR, check_dir=False), name="static"),
    Route("/v1/sessions", create_session, methods=["POST"]),
    Route("/v1/sessions", list_sessions, methods=["GET"]),
    Route("/v1/sessions/status", store_status, methods=["GET"]),
    Route("/v1/sessions/import", import_session, methods=["POST"]),
    Route("/v1/sessions/{sid}", get_session, methods=["GET"]),
    Route("/v1/sessions/{sid}", patch_session, methods=["PATCH"]),
    Route("/v1/sessions/{sid}", delete_session, methods=["DELETE"]),
    Route("/v1/sessions/{sid}/messages", post_message, methods=["POST"]),
    Route("/v1/sessions/{sid}/cancel", cancel_turn, methods=["POST"]),
    Route("/v1/sessions/{sid}/export", export_session, methods=["GET"]),
]


# ── the browser edge: identity cookie and UI security headers ─────────────────────────────────
class BrowserEdgeMiddleware:
    """Gives every client without a valid `chatserve_uid` cookie a new one (192 random bits), seen by
    this very request too, and puts the CSP and friends on UI responses ("/" and "/static/...").

    A request or WebSocket from a foreign Origin (another site, or another port of this host) never
    acts with the browser's cookie identity: it gets a throwaway one, and no Set-Cookie.
    """

    def __init__(self, app: Any, allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed_origins = tuple(allowed_origins)

    def _foreign(self, scope: dict) -> bool:
        origin = host = None
        for k, v in scope.get("headers", []):
            if k == b"origin":
                origin = v.decode("latin-1")
            elif k == b"host":
                host = v.decode("latin-1")
        if origin is None or origin in self.allowed_origins:
            return False
        return urlsplit(origin).netloc != host

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        set_cookie: str | None = None
        foreign = self._foreign(scope)
        if foreign or _cookie_from_scope(scope) is None:
            uid = secrets.token_urlsafe(24)
            scope = {**scope, "headers": _with_cookie(scope["headers"], uid)}
            if not foreign:
                secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
                set_cookie = f"{COOKIE}={uid}; Path=/; Max-Age=31536000; HttpOnly; SameSite=Lax{secure}"
        path = scope.get("path", "")
        is_ui = scope["type"] == "http" and (path == "/" or path.startswith("/static/"))
        if scope["type"] != "http" or (set_cookie is None and not is_ui):
            await self.app(scope, receive, send)
            return

        async def send_wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                hs = list(message.get("headers", []))
                if set_cookie is not None:
                    hs.append((b"set-cookie", set_cookie.encode()))
                if is_ui:
                    hs += [(b"content-security-policy", CSP.encode()),
                           (b"x-content-type-options", b"nosniff"),
                           (b"referrer-policy", b"no-referrer"),
                           (b"x-frame-options", b"DENY")]
                message = {**message, "headers": hs}
            await send(message)

        await self.app(scope, receive, send_wrapped)


def _with_cookie(headers: list, uid: str) -> list:
    """The request headers with our cookie replaced by (or set to) `uid`; other cookies kept."""
    others = []
    for k, v in headers:
        if k == b"cookie":
            others += [p.strip() for p in v.decode("latin-1").split(";")
                       if p.strip() and p.strip().partition("=")[0] != COOKIE]
    out = [(k, v) for k, v in headers if k != b"cookie"]
    out.append((b"cookie", "; ".join([*others, f"{COOKIE}={uid}"]).encode("latin-1")))
    return out


def _cookie_from_scope(scope: dict) -> str | None:
    for k, v in scope.get("headers", []):
        if k != b"cookie":
            continue
        for part in v.decode("latin-1").split(";"):
            name, _, val = part.strip().partition("=")
            if name == COOKIE and COOKIE_RE.match(val):
                return val
    return None


def install(app: Any, state: Any) -> None:
    """Give the app its session store (from state.config.server.redis_url unless state.sessions is
    set), the browser edge middleware, the /v1/ws "session" message type, and a shutdown step that
    waits for replies being saved and then flushes and closes the store."""
    store = getattr(state, "sessions", None)
    if store is None:
        cfg = getattr(getattr(state, "config", None), "server", None)
        store = make_session_store(getattr(cfg, "redis_url", None))
        try:
            state.sessions = store
        except (AttributeError, TypeError):
            pass
    app.state.session_store = store
    app.state.session_turns = TurnRegistry()
    handlers = getattr(state, "ws_handlers", None)
    if isinstance(handlers, dict):
        handlers[WS_MESSAGE_TYPE] = ws_session_handler(app.state)
    (log.warning if not store.persistent else log.info)("%s", store.describe())
    cfg = getattr(getattr(state, "config", None), "server", None)
    app.add_middleware(BrowserEdgeMiddleware, allowed_origins=tuple(getattr(cfg, "cors_origins", ()) or ()))
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as value:
            yield value
        # the engine has drained: end what is left, let the replies be saved, then flush the store
        reg: TurnRegistry = app.state.session_turns
        for t in list(reg.by_session.values()):
            t.cancel()
        deadline = time.monotonic() + 5
        while (reg.by_session or reg.background) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await store.aclose()

    app.router.lifespan_context = lifespan
