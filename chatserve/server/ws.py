"""WebSocket /v1/ws: OpenAI request objects in, the same chunk objects out, several per socket.

Client → {"id": "<client id>", "type": "chat.completions" | "completions" | "cancel" | <extension>,
          ...request fields}. Server → {"id", "type": "chunk", "chunk": {...}}, then exactly one of
{"id", "type": "done"} | {"id", "type": "error", "status", "error": {...}} | {"id", "type": "cancelled"}.
Not the HTTP routes (openai_routes.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, AsyncGenerator

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from chatserve.server.auth import WS_PROTOCOL
from chatserve.server.body import parse_json_bytes
from chatserve.server.chat_service import stream_chat, stream_completion
from chatserve.server.errors import APIError, status_for
from chatserve.server.identity import cache_owner_of, owner_of, rate_key_of
from chatserve.server.origin import origin_allowed
from chatserve.server.admission import admit
from chatserve.server.protocol import new_id, parse_chat_body, parse_completion_body

if TYPE_CHECKING:
    from chatserve.server.state import ServerState

log = logging.getLogger("chatserve.ws")
MAX_INFLIGHT_PER_SOCKET = 32
MAX_CLIENT_ID = 128
CLIENT_CANCEL = "cancelled by the client"   # the CancelledError's message for a {"type": "cancel"}


class _Socket:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws, self.state = ws, state
        self.owner = owner_of(ws)          # sessions (extension handlers)
        self.cache_owner = cache_owner_of(ws)   # prefix cache: per key, per browser, else per client
        self.rate_key = rate_key_of(ws)
        self.tasks: dict[str, asyncio.Task] = {}
        self.lock = asyncio.Lock()
        self.closed = False

    async def send(self, obj: dict) -> None:
        if self.closed:
            return
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        async with self.lock:
            try:
                await asyncio.wait_for(self.ws.send_text(text), self.state.config.server.stream_timeout)
            except (asyncio.TimeoutError, RuntimeError, WebSocketDisconnect, OSError):
                self.closed = True      # a reader that stopped reading, or a socket already gone
                raise WebSocketDisconnect(1011)

    async def error(self, cid: Any, err: APIError) -> None:
        await self.send({"id": cid, "type": "error", "status": err.status, **err.to_dict()})

    async def chunks_for(self, cid: str, kind: str, msg: dict) -> AsyncGenerator[dict, None]:
        body = {k: v for k, v in msg.items() if k not in ("id", "type")}
        body.setdefault("stream", True)     # a socket always streams (so stream_options applies)
        rid = new_id("chatcmpl" if kind == "chat.completions" else "cmpl")
        if kind == "chat.completions":
            req = await admit(self.state, body, parse_chat_body, rate_key=self.rate_key)
            return stream_chat(self.state, req, owner=self.cache_owner, request_id=rid,
                               rate_key=self.rate_key)
        if kind == "completions":
            creq = await admit(self.state, body, parse_completion_body, rate_key=self.rate_key)
            return stream_completion(self.state, creq, owner=self.cache_owner, request_id=rid,
                                     rate_key=self.rate_key)
        handler = self.state.ws_handlers.get(kind)
        if handler is None:
            raise APIError(400, f"unknown message type {kind[:60]!r}", param="type", code="invalid_value")
        return handler(self.state, body, self.owner, rid)

    async def run(self, cid: str, kind: str, msg: dict) -> None:
        chunks = None
        try:
            chunks = await self.chunks_for(cid, kind, msg)
            async for c in chunks:
                if "error" in c:
                    await self.send({"id": cid, "type": "error", "status": status_for(c["error"].get("code")),
                                     **c})
                    return
                await self.send({"id": cid, "type": "chunk", "chunk": c})
            await self.send({"id": cid, "type": "done"})
        except APIError as e:
            await self.error(cid, e)
        except asyncio.CancelledError:
            if not self.closed:
                try:
                    await self.send({"id": cid, "type": "cancelled"})
                except WebSocketDisconnect:
                    pass
            raise
        except WebSocketDisconnect:
            pass
        except Exception:
            log.exception("websocket request %s failed", cid)
            try:
                await self.error(cid, APIError(500, "internal error", type="server_error"))
            except WebSocketDisconnect:
                pass
        finally:
            if chunks is not None:
                await chunks.aclose()
            self.tasks.pop(cid, None)

    async def handle(self, raw: str | bytes | None) -> None:
        if raw is None:
            raise APIError(400, "empty frame", code="invalid_json")
        data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        if len(data) > self.state.config.server.max_body_bytes:
            raise APIError(413, "message over the size limit", code="request_too_large")
        msg = parse_json_bytes(data)
        if not isinstance(msg, dict):
            raise APIError(400, "a message must be a JSON object", code="invalid_json")
        cid = msg.get("id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CLIENT_ID:
            raise APIError(400, f"'id' must be a non-empty string of at most {MAX_CLIENT_ID} characters",
                           param="id", code="invalid_value")
        kind = msg.get("type", "chat.completions")
        if not isinstance(kind, str):
            raise APIError(400, "'type' must be a string", param="type", code="invalid_type")
        if kind == "cancel":
            t = self.tasks.get(cid)
            if t is not None:
                t.cancel(CLIENT_CANCEL)      # a socket that closes cancels without it
            return
        if cid in self.tasks:     # answered untagged: the running request keeps its one ending
            await self.error(None, APIError(400, f"request id {cid!r} is already in use on this socket",
                                            param="id", code="invalid_value"))
            return
        if len(self.tasks) >= MAX_INFLIGHT_PER_SOCKET:
            raise APIError(429, f"at most {MAX_INFLIGHT_PER_SOCKET} requests at once per socket",
                           code="too_many_requests")
        self.tasks[cid] = asyncio.create_task(self.run(cid, kind, msg))


def _cid_of(raw: Any) -> Any:
    try:
        m = json.loads(raw)
        cid = m.get("id") if isinstance(m, dict) else None
        return cid if isinstance(cid, str) and 0 < len(cid) <= MAX_CLIENT_ID else None
    except Exception:
        return None


async def ws_endpoint(ws: WebSocket) -> None:
    state = ws.app.state.chatserve
    # browsers always send Origin on a handshake and cannot forge it: without this check any web page could
    # drive the model (and, keyless, a visitor's chats) through its visitors' browsers
    if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"), tuple(state.config.server.cors_origins)):
        await ws.close(code=1008, reason="origin not allowed")
        return
    offered = ws.scope.get("subprotocols") or []
    await ws.accept(subprotocol=WS_PROTOCOL if WS_PROTOCOL in offered else None)
    sock = _Socket(ws, state)
    try:
        while True:
            m = await ws.receive()
            if m["type"] == "websocket.disconnect":
                break
            raw = m.get("text") if m.get("text") is not None else m.get("bytes")
            try:
                await sock.handle(raw)
            except APIError as e:
                await sock.error(_cid_of(raw) if raw is not None else None, e)
            except Exception as e:  # garbage must never take the socket down
                log.debug("bad websocket frame: %s", e)
                await sock.error(None, APIError(400, "invalid message", code="invalid_json"))
    except WebSocketDisconnect:
        pass
    finally:
        sock.closed = True
        tasks = list(sock.tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


routes = [WebSocketRoute("/v1/ws", ws_endpoint)]
