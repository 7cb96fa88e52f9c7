"""The browser edge: the identity cookie, the UI's security headers, and the same-origin rule.

Written on starlette's header types. Not authentication (auth.py) and not the owner rule
(identity.py), which reads the cookie this middleware guarantees.
"""
from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import HTTPConnection, cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatserve.server.errors import APIError
from chatserve.server.identity import COOKIE_NAME
from chatserve.server.origin import origin_allowed

if TYPE_CHECKING:
    from chatserve.server.state import ServerState

COOKIE_RE = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")
UI_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
              "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def is_foreign(headers: Headers, allowed_origins: tuple[str, ...] = ()) -> bool:
    """A request from another origin than this host's (and not a configured CORS one): server/origin.py."""
    return not origin_allowed(headers.get("origin"), headers.get("host"), allowed_origins)


def allowed_origins_of(state: ServerState) -> tuple[str, ...]:
    return tuple(state.config.server.cors_origins)


def check_origin(conn: HTTPConnection) -> None:
    """403 for a write from a foreign Origin."""
    if is_foreign(conn.headers, allowed_origins_of(conn.app.state.chatserve)):
        raise APIError(403, "cross-origin request refused", code="cross_origin")


class BrowserEdgeMiddleware:
    """Gives every client without a valid `chatserve_uid` cookie a new one (192 random bits), seen by
    this very request too, and puts the CSP and friends on UI responses ("/" and "/static/...").

    A request or WebSocket from a foreign Origin (another site, or another port of this host) never
    acts with the browser's cookie identity: it gets a throwaway one, and no Set-Cookie.
    """

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed_origins = tuple(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        foreign = is_foreign(headers, self.allowed_origins)
        set_cookie: str | None = None
        if foreign or not COOKIE_RE.match(cookie_parser(headers.get("cookie", "")).get(COOKIE_NAME, "")):
            uid = secrets.token_urlsafe(24)
            scope = _with_cookie(scope, uid)
            if not foreign:
                secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
                set_cookie = f"{COOKIE_NAME}={uid}; Path=/; Max-Age=31536000; HttpOnly; SameSite=Lax{secure}"
        path = scope.get("path", "")
        is_ui = scope["type"] == "http" and (path == "/" or path.startswith("/static/"))
        if scope["type"] != "http" or (set_cookie is None and not is_ui):
            await self.app(scope, receive, send)
            return

        async def send_wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", []))}
                out = MutableHeaders(scope=message)
                if set_cookie is not None:
                    out.append("set-cookie", set_cookie)
                if is_ui:
                    for k, v in UI_HEADERS.items():
                        out[k] = v
            await send(message)

        await self.app(scope, receive, send_wrapped)


def _with_cookie(scope: Scope, uid: str) -> Scope:
    """A copy of the scope whose Cookie header has ours replaced by (or set to) `uid`, others kept."""
    scope = {**scope, "headers": list(scope.get("headers", []))}
    h = MutableHeaders(scope=scope)
    others = [f"{k}={v}" for k, v in cookie_parser(h.get("cookie", "")).items() if k != COOKIE_NAME]
    h["cookie"] = "; ".join([*others, f"{COOKIE_NAME}={uid}"])
    return scope
