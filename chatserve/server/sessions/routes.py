"""HTTP routes of chat sessions and the web UI's pages, the /v1/ws "session" message types, and
`install()`, which wires the store, the turn service and the browser edge into the app.

Thin: bodies are read by body.py, validated by inputs.py, turns run in turns.py. See
docs/sessions.md and docs/sessions-api.md.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncGenerator

from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from chatserve.server.body import read_json_object
from chatserve.server.errors import APIError, error_response, invalid
from chatserve.server.identity import cache_owner_of, owner_of, rate_key_of
from chatserve.server.sessions.edge import BrowserEdgeMiddleware, allowed_origins_of, check_origin
from chatserve.server.sessions.inputs import apply_settings, clean_id, import_messages, parse_turn
from chatserve.server.sessions.session import Session
from chatserve.server.sessions.store import (SessionStore, StoreUnavailable,
                                             new_session_id, public_status, valid_session_id)
from chatserve.server.sessions.store_choice import make_session_store
from chatserve.server.sessions.turns import ChatBackend, TurnService, busy, not_found
from chatserve.server.ws import CLIENT_CANCEL

if TYPE_CHECKING:
    from chatserve.server.state import ServerState

log = logging.getLogger("chatserve.sessions")

STATIC_DIR = Path(__file__).resolve().parents[3] / "static"
EXPORT_FORMAT = "chatserve.session.v2"
IMPORT_FORMATS = ("chatserve.session.v1", EXPORT_FORMAT)


def _turns(conn: HTTPConnection) -> TurnService:
    turns: TurnService = conn.app.state.session_turns       # set by install()
    return turns


def _store(conn: HTTPConnection) -> SessionStore:
    return _turns(conn).store


def _unavailable(e: StoreUnavailable) -> APIError:
    return APIError(503, str(e), code="session_store_unavailable", retry_after=2)


def _store_header(store: SessionStore) -> dict[str, str]:
    st = store.status()
    return {"X-Chatserve-Session-Store": "memory" if not st["persistent"]
            else ("degraded" if st["degraded"] else "ok")}


def _renderable(obj: Any) -> bool:
    """Whether `obj` can be written as strict JSON (finite numbers, UTF-8 strings)."""
    try:
        json.dumps(obj, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return True
    except (ValueError, TypeError, UnicodeEncodeError):
        return False


def _respond(store: SessionStore, content: Any, status: int = 200) -> JSONResponse:
    if not _renderable(content):
        log.error("session response not renderable as JSON; refused")
        raise APIError(500, "this session's stored data cannot be read", type="server_error",
                       code="session_unreadable")
    return JSONResponse(content, status_code=status, headers=_store_header(store))


async def _body(request: Request) -> dict[str, Any]:
    """A write's JSON body: application/json only (forces a CORS preflight on cross-origin pages),
    same origin, then the server's strict reader (NaN, Infinity, 1e400, lone surrogates, deep
    nesting → 400)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, "Content-Type must be application/json", code="unsupported_media_type")
    check_origin(request)
    return await read_json_object(request, request.app.state.chatserve.config.server.max_body_bytes)


def handles_errors(fn: Any) -> Any:
    """Route decorator: APIError and StoreUnavailable become their JSON error responses."""
    async def wrapper(request: Request) -> Response:
        try:
            response: Response = await fn(request)
            return response
        except APIError as e:
            return error_response(e)
        except StoreUnavailable as e:
            return error_response(_unavailable(e))
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


async def _get_own(request: Request) -> tuple[SessionStore, Session]:
    sid = request.path_params["sid"]
    store = _store(request)
    s = await store.get(owner_of(request), sid) if valid_session_id(sid) else None
    if s is None:
        raise not_found()
    return store, s


def _public(request: Request, s: Session) -> dict[str, Any]:
    out = s.public()
    live = _turns(request).live(s.owner, s.id)
    if live is not None:                    # this process knows better than the stored heartbeat
        out["generating"] = True
        out["turn"] = {"id": live.id, "message_id": live.message_id, "phase": live.phase}
    return out


# ── REST: sessions ──────────────────────────────────────────────────────────────────────────
@handles_errors
async def create_session(request: Request) -> Response:
    body = await _body(request)
    s = Session(id=new_session_id(), owner=owner_of(request))
    apply_settings(s, body, request.app.state.chatserve)
    store = _store(request)
    return _respond(store, (await store.create(s)).public(), 201)


@handles_errors
async def list_sessions(request: Request) -> Response:
    """The owner's sessions, newest first; a record that cannot be rendered is skipped and logged."""
    try:
        limit = max(1, min(500, int(request.query_params.get("limit", "100"))))
    except ValueError:
        raise invalid("limit must be an integer", "limit") from None
    store = _store(request)
    data = []
    for s in await store.list(owner_of(request), limit):
        try:
            d = s.summary()
        except Exception as e:
            d = {"error": e}
        if _renderable(d):
            data.append(d)
        else:
            log.warning("session %s: stored record cannot be rendered; left out of the list", s.id)
    return _respond(store, {"object": "list", "data": data})


async def store_status(request: Request) -> Response:
    store = _store(request)
    return _respond(store, public_status(store))


@handles_errors
async def get_session(request: Request) -> Response:
    store, s = await _get_own(request)
    return _respond(store, _public(request, s))


@handles_errors
async def patch_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    body = await _body(request)
    state = request.app.state.chatserve
    apply_settings(Session(id="x" * 22, owner=""), body, state)           # validate before touching it
    store = _store(request)
    s = (await store.update(owner_of(request), sid, lambda s: apply_settings(s, body, state))
         if valid_session_id(sid) else None)
    if s is None:
        raise not_found()
    return _respond(store, _public(request, s))


@handles_errors
async def delete_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    check_origin(request)
    owner, store = owner_of(request), _store(request)
    if not (valid_session_id(sid) and await store.delete(owner, sid)):
        raise not_found()
    _turns(request).cancel(owner, sid)
    return _respond(store, {"id": sid, "object": "session", "deleted": True})


@handles_errors
async def select_branch(request: Request) -> Response:
    """POST /v1/sessions/{id}/branch {"message_id"}: show the branch through that message."""
    sid = request.path_params["sid"]
    body = await _body(request)
    mid = clean_id(body.get("message_id"), "message_id")
    owner, store = owner_of(request), _store(request)
    if _turns(request).live(owner, sid) is not None:
        raise busy()

    def select(s: Session) -> None:
        if s.turn_live():
            raise busy()
        if not s.select(mid):
            raise invalid("no such message in this session", "message_id", "message_not_found")

    s = await store.update(owner, sid, select) if valid_session_id(sid) else None
    if s is None:
        raise not_found()
    return _respond(store, _public(request, s))


@handles_errors
async def export_session(request: Request) -> Response:
    store, s = await _get_own(request)
    doc = {"format": EXPORT_FORMAT, "title": s.title, "created": s.created, "updated": s.updated,
           "model": s.model, "system_prompt": s.system_prompt, "params": s.params,
           "messages": [{k: m[k] for k in ("role", "content", "reasoning_content", "created", "usage",
                                                 "finish_reason", "error")
                         if k in m} for m in s.public_messages()],
           "tree": s.tree()}
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", s.title)[:40].strip("-") or "chat"
    resp = _respond(store, doc)
    resp.headers["Content-Disposition"] = f'attachment; filename="{safe}.json"'
    return resp


@handles_errors
async def import_session(request: Request) -> Response:
    """An export document (v1: flat messages; v2: with every version) → a new session."""
    body = await _body(request)
    if body.get("format", EXPORT_FORMAT) not in IMPORT_FORMATS:
        raise invalid(f"unknown format; expected one of {', '.join(IMPORT_FORMATS)}", "format")
    s = Session(id=new_session_id(), owner=owner_of(request))
    apply_settings(s, {k: body[k] for k in ("title", "system_prompt", "params", "model") if k in body},
                   request.app.state.chatserve)
    import_messages(s, body)
    store = _store(request)
    return _respond(store, (await store.create(s)).public(), 201)


# ── turns ───────────────────────────────────────────────────────────────────────────────────
@handles_errors
async def post_message(request: Request) -> Response:
    """POST /v1/sessions/{id}/messages: one turn, streamed as SSE chunks (or JSON with stream=false)."""
    sid = request.path_params["sid"]
    body = await _body(request)
    turns = _turns(request)
    treq = parse_turn(body, request.app.state.chatserve)
    owner = owner_of(request)
    # a keyless caller without a cookie: its own prefix cache (by address), not the shared "anonymous"
    chunks = await turns.start(owner, sid, treq, rate_key_of(request), cache_owner_of(request))
    if not treq.stream:
        message_id = None
        async for c in chunks:
            if c.get("object") == "chatserve.turn":
                message_id = c["message_id"]
        s = await turns.store.get(owner, sid)
        msgs = s.public_messages() if s is not None else []
        idx = next((i for i, m in enumerate(msgs) if m["id"] == message_id), None)
        return _respond(turns.store, {"session_id": sid, "index": idx,
                                      "message": msgs[idx] if idx is not None else None})
    from chatserve.server.sse import sse_response
    return sse_response(chunks, request)


@handles_errors
async def attach_turn(request: Request) -> Response:
    """POST /v1/sessions/{id}/attach: follow the running turn (SSE), after its text so far."""
    check_origin(request)
    chunks = _turns(request).attach(owner_of(request), request.path_params["sid"])
    from chatserve.server.sse import sse_response
    return sse_response(chunks, request)


@handles_errors
async def cancel_turn(request: Request) -> Response:
    """POST /v1/sessions/{id}/cancel: Stop. Every follower's stream ends with finish_reason "abort"."""
    sid = request.path_params["sid"]
    check_origin(request)
    return JSONResponse({"id": sid, "cancelled": _turns(request).cancel(owner_of(request), sid)})


def ws_handlers(turns: TurnService) -> dict[str, Any]:
    """The /v1/ws extensions. "session": {session_id, content, ...} starts a turn and follows it;
    "session.attach": {session_id} follows the running one; "session.cancel": {session_id} stops it.
    A {"type": "cancel", "id"} of the first two stops the turn too; a closed socket only stops
    following (the turn goes on, to be re-attached)."""
    async def follow(owner: str, sid: str, chunks: AsyncGenerator[dict[str, Any], None]
                     ) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async for c in chunks:
                yield c
        except asyncio.CancelledError as e:
            if e.args and e.args[0] == CLIENT_CANCEL:     # Stop; a closed socket only stops following
                turns.cancel(owner, sid)
            raise
        finally:                    # closed at once (not at GC)
            await chunks.aclose()

    async def start(state: Any, body: dict[str, Any], owner: str,
                    request_id: str) -> AsyncGenerator[dict[str, Any], None]:
        sid = str(body.get("session_id", ""))
        try:
            chunks = await turns.start(owner, sid, parse_turn(body, state))
        except StoreUnavailable as e:
            raise _unavailable(e) from None
        async for c in follow(owner, sid, chunks):
            yield c

    def attach(state: Any, body: dict[str, Any], owner: str,
               request_id: str) -> AsyncGenerator[dict[str, Any], None]:
        sid = str(body.get("session_id", ""))
        return follow(owner, sid, turns.attach(owner, sid))

    async def cancel(state: Any, body: dict[str, Any], owner: str,
                     request_id: str) -> AsyncGenerator[dict[str, Any], None]:
        turns.cancel(owner, str(body.get("session_id", "")))
        return
        yield {}

    return {"session": start, "session.attach": attach, "session.cancel": cancel}


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
    Route("/v1/sessions/{sid}/attach", attach_turn, methods=["POST"]),
    Route("/v1/sessions/{sid}/branch", select_branch, methods=["POST"]),
    Route("/v1/sessions/{sid}/cancel", cancel_turn, methods=["POST"]),
    Route("/v1/sessions/{sid}/export", export_session, methods=["GET"]),
]


def install(app: Any, state: ServerState, backend: ChatBackend | None = None) -> None:
    """Give the app its session store (from state.config.server.redis_url unless state.sessions is
    set), the turn service, the browser edge middleware, the /v1/ws session message types, and a
    shutdown hook that lets running replies finish (up to the drain timeout), saves the rest and
    closes the store."""
    store, cfg = state.sessions, state.config.server
    if store is None:
        store = make_session_store(cfg.redis_url)
        state.sessions = store
    turns = TurnService(app.state, state, store, backend)   # backend: chat_service unless a test scripts one
    app.state.session_store = store
    app.state.session_turns = turns
    state.ws_handlers.update(ws_handlers(turns))
    (log.warning if not store.persistent else log.info)("%s", store.describe())
    app.add_middleware(BrowserEdgeMiddleware, allowed_origins=allowed_origins_of(state))

    async def shutdown() -> None:
        await turns.shutdown(float(cfg.drain_timeout or 0))

    state.shutdown_hooks.append(shutdown)
