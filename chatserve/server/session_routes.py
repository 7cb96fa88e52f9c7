"""HTTP and WebSocket routes for chat sessions, the web UI's pages, and the browser edge middleware.

A turn (POST /v1/sessions/{id}/messages or a /v1/sessions/ws frame) appends the user message, generates
from the stored history through chat_service.stream_chat and stores the reply with its usage. The
store lives in sessions.py; the OpenAI routes and the engine are elsewhere.
"""
from __future__ import annotations

import asyncio
import hashlib
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
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from chatserve.server.sessions import (Session, SessionStore, StoreUnavailable, make_session_store,
                                       new_session_id, valid_session_id)

log = logging.getLogger("chatserve.sessions")

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
COOKIE = "chatserve_uid"
COOKIE_RE = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
                 "seed": int, "repetition_penalty": float, "presence_penalty": float,
                 "frequency_penalty": float, "stop": list}
MAX_CONTENT_CHARS = 200_000
MAX_TITLE_CHARS = 200
MAX_IMPORT_MESSAGES = 5_000
ROLES = ("user", "assistant", "system")


# ── the chat backend: chat_service by default; tests may put another on app.state ───────────────
class ChatBackend(Protocol):
    def parse(self, body: dict, state: Any) -> Any: ...
    def stream(self, state: Any, req: Any, *, owner: str, keep_warm: bool,
               request_id: str | None) -> AsyncIterator[dict]: ...


class _ChatService:
    """Adapter over chatserve.server.chat_service (imported on first use)."""

    def parse(self, body: dict, state: Any) -> Any:
        from chatserve.server import chat_service
        return chat_service.parse_chat_body(body, state)

    def stream(self, state: Any, req: Any, *, owner: str, keep_warm: bool,
               request_id: str | None) -> AsyncIterator[dict]:
        from chatserve.server import chat_service
        return chat_service.stream_chat(state, req, owner=owner, keep_warm=keep_warm,
                                        request_id=request_id)


_DEFAULT_BACKEND = _ChatService()


def _backend(conn: HTTPConnection) -> ChatBackend:
    """Test hook: `app.state.session_chat_backend = obj` replaces the model (see docs/sessions.md)."""
    return getattr(conn.app.state, "session_chat_backend", None) or _DEFAULT_BACKEND


class HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def _error(status: int, message: str, code: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": status}},
                        status_code=status, headers=headers)


def _api_error_response(e: Exception) -> Response:
    """Turn chat_service's APIError (or ours) into a response."""
    if isinstance(e, HTTPError):
        return _error(e.status, e.message, e.code, e.headers)
    try:
        from chatserve.server import chat_service
        if isinstance(e, chat_service.APIError):
            return chat_service.error_response(e)
    except ImportError:
        pass
    status = getattr(e, "status", None) or getattr(e, "status_code", None) or 400
    return _error(int(status), str(e))


# ── who is asking ───────────────────────────────────────────────────────────────────────────
def owner_of(conn: HTTPConnection) -> str:
    try:
        from chatserve.server.identity import owner_of as server_owner_of
        return server_owner_of(conn)  # type: ignore[arg-type]
    except ImportError:
        pass
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return "key:" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:24]
    uid = conn.cookies.get(COOKIE)
    return f"browser:{uid}" if uid else "anonymous"


def _state(conn: HTTPConnection) -> Any:
    return conn.app.state.chatserve


def _store(conn: HTTPConnection) -> SessionStore:
    st = getattr(_state(conn), "sessions", None)
    return st if st is not None else conn.app.state.session_store


def _same_origin(conn: HTTPConnection) -> bool:
    """Requests that carry an Origin must come from this host (or a configured CORS origin)."""
    origin = conn.headers.get("origin")
    if not origin:
        return True
    host = conn.headers.get("host", "")
    if urlsplit(origin).netloc == host:
        return True
    cfg = getattr(getattr(_state(conn), "config", None), "server", None)
    return origin in tuple(getattr(cfg, "cors_origins", ()) or ())


async def _json_body(request: Request) -> dict:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":      # forces a CORS preflight for cross-origin writers
        raise HTTPError(415, "Content-Type must be application/json")
    if not _same_origin(request):
        raise HTTPError(403, "cross-origin request refused", "forbidden")
    try:
        body = json.loads(await request.body() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise HTTPError(400, "body is not valid JSON")
    if not isinstance(body, dict):
        raise HTTPError(400, "body must be a JSON object")
    return body


def _store_header(store: SessionStore) -> dict[str, str]:
    st = store.status()
    return {"X-Chatserve-Session-Store": "memory" if not st["persistent"]
            else ("degraded" if st["degraded"] else "ok")}


def _respond(store: SessionStore, content: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status, headers=_store_header(store))


def _unavailable(e: StoreUnavailable) -> JSONResponse:
    return _error(503, str(e), "session_store_unavailable", {"Retry-After": "2"})


# ── validation of what users may set ────────────────────────────────────────────────────────
def _clean_params(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise HTTPError(400, "params must be an object")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in SAMPLING_KEYS:
            raise HTTPError(400, f"unknown sampling parameter {k!r}")
        if v is None:
            continue
        want = SAMPLING_KEYS[k]
        if want is list:
            if isinstance(v, str):
                v = [v]
            if not (isinstance(v, list) and len(v) <= 4 and all(isinstance(x, str) for x in v)):
                raise HTTPError(400, "stop must be a string or a list of up to 4 strings")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and v != int(v)):
            raise HTTPError(400, f"{k} must be a number")
        else:
            v = want(v)
        out[k] = v
    return out


def _clean_text(v: Any, name: str, limit: int) -> str:
    if not isinstance(v, str):
        raise HTTPError(400, f"{name} must be a string")
    if len(v) > limit:
        raise HTTPError(400, f"{name} is longer than {limit} characters")
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


# ── REST: sessions ──────────────────────────────────────────────────────────────────────────
async def create_session(request: Request) -> Response:
    try:
        body = await _json_body(request)
        s = Session(id=new_session_id(), owner=owner_of(request))
        _apply_settings(s, body)
        store = _store(request)
        s = await store.create(s)
    except HTTPError as e:
        return _api_error_response(e)
    except StoreUnavailable as e:
        return _unavailable(e)
    return _respond(store, s.public(), 201)


async def list_sessions(request: Request) -> Response:
    try:
        limit = max(1, min(500, int(request.query_params.get("limit", "100"))))
    except ValueError:
        return _error(400, "limit must be an integer")
    store = _store(request)
    try:
        items = await store.list(owner_of(request), limit)
    except StoreUnavailable as e:
        return _unavailable(e)
    return _respond(store, {"object": "list", "data": [s.summary() for s in items],
                            "store": store.status()})


async def store_status(request: Request) -> Response:
    store = _store(request)
    return _respond(store, store.status())


async def _get_own(request: Request) -> tuple[SessionStore, Session]:
    sid = request.path_params["sid"]
    store = _store(request)
    s = await store.get(owner_of(request), sid) if valid_session_id(sid) else None
    if s is None:
        raise HTTPError(404, "session not found", "not_found")
    return store, s


async def get_session(request: Request) -> Response:
    try:
        store, s = await _get_own(request)
    except HTTPError as e:
        return _api_error_response(e)
    except StoreUnavailable as e:
        return _unavailable(e)
    out = s.public()
    out["generating"] = s.id in _turns(request).by_session
    return _respond(store, out)


async def patch_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    try:
        body = await _json_body(request)
        _apply_settings(Session(id="x" * 22, owner=""), body)        # validate before touching it
        store = _store(request)
        s = await store.update(owner_of(request), sid, lambda s: _apply_settings(s, body)) \
            if valid_session_id(sid) else None
    except HTTPError as e:
        return _api_error_response(e)
    except StoreUnavailable as e:
        return _unavailable(e)
    if s is None:
        return _error(404, "session not found", "not_found")
    return _respond(store, s.public())


async def delete_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    if not _same_origin(request):
        return _error(403, "cross-origin request refused", "forbidden")
    store = _store(request)
    try:
        ok = valid_session_id(sid) and await store.delete(owner_of(request), sid)
    except StoreUnavailable as e:
        return _unavailable(e)
    if not ok:
        return _error(404, "session not found", "not_found")
    turn = _turns(request).by_session.get(sid)
    if turn is not None:
        turn.cancel()
    return _respond(store, {"id": sid, "object": "session", "deleted": True})


EXPORT_FORMAT = "chatserve.session.v1"


async def export_session(request: Request) -> Response:
    try:
        store, s = await _get_own(request)
    except HTTPError as e:
        return _api_error_response(e)
    except StoreUnavailable as e:
        return _unavailable(e)
    doc = {"format": EXPORT_FORMAT, "title": s.title, "created": s.created, "updated": s.updated,
           "model": s.model, "system_prompt": s.system_prompt, "params": s.params,
           "messages": s.messages}
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", s.title)[:40].strip("-") or "chat"
    return JSONResponse(doc, headers={"Content-Disposition": f'attachment; filename="{safe}.json"'})


def _clean_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or len(raw) > MAX_IMPORT_MESSAGES:
        raise HTTPError(400, f"messages must be a list of at most {MAX_IMPORT_MESSAGES}")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise HTTPError(400, "each message needs a role: user, assistant or system")
        msg: dict[str, Any] = {"role": m["role"],
                               "content": _clean_text(m.get("content", ""), "content", MAX_CONTENT_CHARS),
                               "created": float(m["created"]) if isinstance(m.get("created"), (int, float))
                               else time.time()}
        if m["role"] == "assistant" and isinstance(m.get("usage"), dict):
            msg["usage"] = {k: v for k, v in m["usage"].items()
                            if k in USAGE_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if isinstance(m.get("finish_reason"), str):
            msg["finish_reason"] = m["finish_reason"][:20]
        out.append(msg)
    return out


async def import_session(request: Request) -> Response:
    try:
        body = await _json_body(request)
        if body.get("format", EXPORT_FORMAT) != EXPORT_FORMAT:
            raise HTTPError(400, f"unknown format; expected {EXPORT_FORMAT}")
        s = Session(id=new_session_id(), owner=owner_of(request))
        _apply_settings(s, {k: body[k] for k in ("title", "system_prompt", "params", "model")
                            if k in body})
        s.messages = _clean_messages(body.get("messages", []))
        store = _store(request)
        s = await store.create(s)
    except HTTPError as e:
        return _api_error_response(e)
    except StoreUnavailable as e:
        return _unavailable(e)
    return _respond(store, s.public(), 201)


# ── turns: one generation per session at a time, cancellable from anywhere in this process ──────
USAGE_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "tokens_per_s", "queue_s")


@dataclass
class Turn:
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
    background: set = field(default_factory=set)


def _turns(conn: HTTPConnection) -> TurnRegistry:
    reg = getattr(conn.app.state, "session_turns", None)
    if reg is None:
        reg = conn.app.state.session_turns = TurnRegistry()
    return reg


@dataclass
class PreparedTurn:
    session: Session
    chat_request: Any
    turn: Turn


async def prepare_turn(conn: HTTPConnection, sid: str, body: dict) -> PreparedTurn:
    """Validate, store the user's message, and build the chat request from the stored history."""
    owner = owner_of(conn)
    store, reg = _store(conn), _turns(conn)
    content = body.get("content")
    if content is not None:
        content = _clean_text(content, "content", MAX_CONTENT_CHARS)
    replace_from = body.get("replace_from")
    if replace_from is not None and (isinstance(replace_from, bool) or not isinstance(replace_from, int)
                                     or replace_from < 0):
        raise HTTPError(400, "replace_from must be a message index")
    regenerate = bool(body.get("regenerate"))
    overrides = _clean_params({k: v for k, v in body.items() if k in SAMPLING_KEYS})
    if content is None and replace_from is None and not regenerate:
        raise HTTPError(400, "content is required")
    if not valid_session_id(sid):
        raise HTTPError(404, "session not found", "not_found")
    if sid in reg.by_session:
        raise HTTPError(409, "a reply is already being generated in this session", "conflict")
    turn = Turn(session_id=sid, owner=owner)
    reg.by_session[sid] = turn                       # claim before any await
    try:
        def add_user(s: Session) -> None:
            msgs = s.messages
            if replace_from is not None:
                if replace_from > len(msgs):
                    raise HTTPError(400, "replace_from is past the end of the conversation")
                del msgs[replace_from:]
            elif regenerate:
                while msgs and msgs[-1]["role"] == "assistant":
                    msgs.pop()
            if content is not None:
                msgs.append({"role": "user", "content": content, "created": time.time()})
                if s.title == "New chat" and sum(m["role"] == "user" for m in msgs) == 1:
                    s.title = " ".join(content.split())[:60] or "New chat"
            if not msgs or msgs[-1]["role"] != "user":
                raise HTTPError(400, "nothing to answer: the conversation must end with a user message")

        # validate against a preview first, so a rejected request leaves the session untouched
        cur = await store.get(owner, sid)
        if cur is None:
            raise HTTPError(404, "session not found", "not_found")
        add_user(cur)
        state, backend = _state(conn), _backend(conn)
        req = _parse_turn(backend, state, cur, overrides)
        s = await store.update(owner, sid, add_user)
        if s is None:
            raise HTTPError(404, "session not found", "not_found")
        def key(x: Session) -> tuple:
            return ([(m["role"], m["content"]) for m in x.messages], x.params, x.system_prompt, x.model)

        if key(s) != key(cur):
            req = _parse_turn(backend, state, s, overrides)     # changed meanwhile (another process)
        return PreparedTurn(session=s, chat_request=req, turn=turn)
    except BaseException:
        reg.by_session.pop(sid, None)
        raise


def _parse_turn(backend: ChatBackend, state: Any, s: Session, overrides: dict) -> Any:
    chat: dict[str, Any] = {
        "model": s.model or getattr(state, "model_name", None) or "default",
        "messages": ([{"role": "system", "content": s.system_prompt}] if s.system_prompt else [])
        + [{"role": m["role"], "content": m["content"]} for m in s.messages],
        "stream": True, "stream_options": {"include_usage": True},
        **s.params, **overrides}
    try:
        return backend.parse(chat, state)
    except Exception as e:
        raise _as_http(e)


def _as_http(e: Exception) -> HTTPError:
    if isinstance(e, HTTPError):
        return e
    status = getattr(e, "status", None) or getattr(e, "status_code", None) or 400
    msg = getattr(e, "message", None) or str(e)
    return HTTPError(int(status), str(msg))


async def run_turn(conn: HTTPConnection, p: PreparedTurn) -> AsyncIterator[dict]:
    """Stream the reply's chunks; store the reply (also a partial one on Stop/disconnect) at the end.

    The model is driven by a pump task so that cancel() from another request (Stop) stops it at
    once; stream_chat sees the cancellation and aborts the engine request.
    """
    reg, store, state = _turns(conn), _store(conn), _state(conn)
    backend, turn, sid = _backend(conn), p.turn, p.session.id
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump() -> None:
        agen = backend.stream(state, p.chat_request, owner=turn.owner, keep_warm=True,
                              request_id=f"sess-{sid[:8]}-{secrets.token_hex(4)}")
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
    n_content_chunks = 0
    error: str | None = None
    task = asyncio.get_running_loop().create_task(pump())
    task.add_done_callback(lambda _t: queue.put_nowait(done))
    turn.task = task
    try:
        while True:
            item = await queue.get()
            if item is done:
                break
            for ch in item.get("choices") or []:
                delta = ch.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                    n_content_chunks += 1
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
            if item.get("usage"):
                usage = item["usage"]
            yield item
        if task.cancelled() or turn.cancelled:
            finish = "abort"
            yield {"id": f"chatcmpl-{sid[:8]}", "object": "chat.completion.chunk",
                   "created": int(time.time()), "model": p.session.model or "",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}
        elif task.exception() is not None:
            exc = task.exception()
            error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            log.warning("session %s: generation failed: %s", sid, error)
            finish = "error"
            yield {"error": {"message": error, "type": "generation_error"}}
    finally:
        if not task.done():                   # the client went away: abort the generation
            turn.cancelled = True
            task.cancel()
        reply = "".join(text)
        u = _usage_record(usage, t0, first_token_at, n_content_chunks)
        msg = {"role": "assistant", "content": reply, "created": time.time(),
               "finish_reason": finish or ("abort" if turn.cancelled else "stop"), "usage": u}
        if error:
            msg["error"] = error

        async def save() -> None:
            try:
                if reply or not error:
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


def _usage_record(usage: dict | None, t0: float, first: float | None, n_chunks: int) -> dict:
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
    u.setdefault("completion_tokens", n_chunks)      # stopped early: no usage chunk came
    if "ttft_s" not in u and first is not None:
        u["ttft_s"] = round(first - t0, 4)
    if "tokens_per_s" not in u and first is not None and now > first and u["completion_tokens"]:
        u["tokens_per_s"] = round(max(0, (u["completion_tokens"] or 1) - 1) / (now - first), 2)
    return {k: v for k, v in u.items() if v is not None}


def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async def gen() -> AsyncIterator[str]:
        async for c in chunks:
            yield f"data: {json.dumps(c, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"
    return gen()


async def post_message(request: Request) -> Response:
    sid = request.path_params["sid"]
    try:
        body = await _json_body(request)
        p = await prepare_turn(request, sid, body)
    except HTTPError as e:
        return _api_error_response(e)
    except StoreUnavailable as e:
        return _unavailable(e)
    store = _store(request)
    if body.get("stream", True) is False:
        async for _chunk in run_turn(request, p):
            pass
        s = await store.get(p.turn.owner, sid)
        last = s.messages[-1] if s and s.messages else None
        return _respond(store, {"session_id": sid, "index": len(s.messages) - 1 if s else None,
                                "message": last})
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **_store_header(store)}
    return StreamingResponse(_sse(run_turn(request, p)), media_type="text/event-stream",
                             headers=headers)


async def cancel_turn(request: Request) -> Response:
    sid = request.path_params["sid"]
    if not _same_origin(request):
        return _error(403, "cross-origin request refused", "forbidden")
    turn = _turns(request).by_session.get(sid)
    if turn is None or turn.owner != owner_of(request):
        return JSONResponse({"id": sid, "cancelled": False})
    turn.cancel()
    return JSONResponse({"id": sid, "cancelled": True})


# ── WebSocket: {"id", "session_id", "content", ...} in; {"type": "chunk"|"done"|"error", "id"} out ─
async def sessions_ws(ws: WebSocket) -> None:
    if not _same_origin(ws):
        await ws.close(code=1008)
        return
    await ws.accept()
    running: dict[str, tuple[asyncio.Task, PreparedTurn | None]] = {}
    send_lock = asyncio.Lock()

    async def send(obj: dict) -> None:
        async with send_lock:
            await ws.send_text(json.dumps(obj, separators=(",", ":")))

    async def serve_turn(cid: str, msg: dict) -> None:
        try:
            try:
                p = await prepare_turn(ws, str(msg.get("session_id", "")), msg)
            except HTTPError as e:
                await send({"type": "error", "id": cid, "status": e.status, "error": {"message": e.message}})
                return
            except StoreUnavailable as e:
                await send({"type": "error", "id": cid, "status": 503, "error": {"message": str(e)}})
                return
            running[cid] = (running[cid][0], p)
            async for chunk in run_turn(ws, p):
                await send({"type": "chunk", "id": cid, "data": chunk})
            await send({"type": "done", "id": cid, "session_id": p.session.id})
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            running.pop(cid, None)

    try:
        while True:
            try:
                msg = json.loads(await ws.receive_text())
            except ValueError:
                await send({"type": "error", "id": None, "error": {"message": "frames must be JSON"}})
                continue
            if not isinstance(msg, dict):
                continue
            cid = str(msg.get("id") or "")
            if msg.get("type") == "cancel":
                entry = running.get(cid)
                if entry is not None and entry[1] is not None:
                    entry[1].turn.cancel()
                continue
            if msg.get("type") == "status":
                await send({"type": "status", "store": _store(ws).status()})
                continue
            if not cid or cid in running:
                await send({"type": "error", "id": cid, "error": {"message": "each turn needs a new id"}})
                continue
            running[cid] = (asyncio.get_running_loop().create_task(serve_turn(cid, msg)), None)
    except WebSocketDisconnect:
        pass
    finally:
        for task, p in list(running.values()):
            if p is not None:
                p.turn.cancel()
            task.cancel()


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
    WebSocketRoute("/v1/sessions/ws", sessions_ws),
    Route("/v1/sessions/{sid}", get_session, methods=["GET"]),
    Route("/v1/sessions/{sid}", patch_session, methods=["PATCH"]),
    Route("/v1/sessions/{sid}", delete_session, methods=["DELETE"]),
    Route("/v1/sessions/{sid}/messages", post_message, methods=["POST"]),
    Route("/v1/sessions/{sid}/cancel", cancel_turn, methods=["POST"]),
    Route("/v1/sessions/{sid}/export", export_session, methods=["GET"]),
]


# ── the browser edge: identity cookie and UI security headers ─────────────────────────────────
class BrowserEdgeMiddleware:
    """Gives every client without a valid `chatserve_uid` cookie a new one (192 random bits), visible
    to this very request too, and puts the CSP and friends on UI responses ("/" and "/static/...")."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        uid = _cookie_from_scope(scope)
        set_cookie: str | None = None
        if uid is None:
            uid = secrets.token_urlsafe(24)
            headers = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
            old = b"; ".join(v for k, v in scope["headers"] if k == b"cookie")
            headers.append((b"cookie", (old + b"; " if old else b"") + f"{COOKIE}={uid}".encode()))
            scope = {**scope, "headers": headers}
            secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
            set_cookie = (f"{COOKIE}={uid}; Path=/; Max-Age=31536000; HttpOnly; SameSite=Lax{secure}")
        path = scope.get("path", "")
        is_ui = scope["type"] == "http" and (path == "/" or path.startswith("/static/"))
        if set_cookie is None and not is_ui:
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
    set), the browser edge middleware, and a shutdown hook that flushes and closes the store."""
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
    (log.warning if not store.persistent else log.info)("%s", store.describe())
    app.add_middleware(BrowserEdgeMiddleware)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as value:
            try:
                yield value
            finally:
                reg: TurnRegistry = app.state.session_turns
                for t in list(reg.by_session.values()):
                    t.cancel()
                if reg.background:
                    await asyncio.wait(list(reg.background), timeout=5)
                await store.aclose()

    app.router.lifespan_context = lifespan
