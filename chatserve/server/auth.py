"""API-key check as ASGI middleware: deny by default on /v1/*, /v1/ws, /tokenize, /detokenize and
/reset_prefix_cache.

Keys are compared in constant time (HMAC digests of equal length); several keys may be configured.
Not identity (identity.py reads what this records) and not rate limiting (ratelimit.py).
"""
from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from chatserve.server.errors import APIError, error_response
from chatserve.server.identity import SCOPE_KEY_ID, key_id

WS_PROTOCOL = "chatserve"                 # browsers pass the key as a second subprotocol:
WS_KEY_PREFIX = "chatserve.bearer."       # new WebSocket(url, ["chatserve", "chatserve.bearer.<key>"])
PROTECTED_EXACT = ("/v1", "/tokenize", "/detokenize", "/reset_prefix_cache")


def _digest(s: str) -> bytes:
    return hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()


def is_protected(path: str) -> bool:
    return path.startswith("/v1/") or path in PROTECTED_EXACT


def presented_key(scope: Scope) -> str | None:
    """The key the client sent: Authorization: Bearer, or (WebSocket only) ?api_key= / subprotocol."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            v = value.decode("latin-1").strip()
            if v[:7].lower() == "bearer ":
                return v[7:].strip()
    if scope["type"] == "websocket":
        qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if qs.get("api_key"):
            return qs["api_key"][0]
        for p in scope.get("subprotocols", []) or []:
            if p.startswith(WS_KEY_PREFIX):
                return p[len(WS_KEY_PREFIX):]
    return None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self._digests = [_digest(k) for k in keys]

    def check(self, key: str | None) -> bool:
        if key is None:
            return False
        d = _digest(key)
        ok = False
        for ref in self._digests:             # every key is compared; no early exit
            ok |= hmac.compare_digest(d, ref)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self._digests:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope)
        if self.check(key):
            assert key is not None
            scope.setdefault("state", {})[SCOPE_KEY_ID] = key_id(key)
        elif is_protected(scope["path"]):
            if scope["type"] == "websocket":
                await receive()                               # websocket.connect
                await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
                return
            msg = "missing API key" if key is None else "invalid API key"
            await error_response(APIError(401, msg, code="invalid_api_key"))(scope, receive, send)
            return
        await self.app(scope, receive, send)
