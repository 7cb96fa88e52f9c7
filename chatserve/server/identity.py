"""Who is asking: an owner string per request, and the per-owner prefix-cache salt.

"key:<sha256(key)[:16]>" when authenticated by API key, else "browser:<cookie>", else "anonymous".
Not authentication itself (see auth.py) and not the cookie's issuance (the sessions module).
"""
from __future__ import annotations

import hashlib
import hmac
import re

from starlette.requests import HTTPConnection

COOKIE_NAME = "chatserve_uid"
SCOPE_KEY_ID = "chatserve_key_id"      # set in scope["state"] by the API-key middleware
_COOKIE_OK = re.compile(r"^[A-Za-z0-9_\-]{8,128}$")


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def owner_of(conn: HTTPConnection) -> str:
    """The owner of an HTTP request or WebSocket: key, browser cookie, or anonymous."""
    kid = (conn.scope.get("state") or {}).get(SCOPE_KEY_ID)
    if kid:
        return f"key:{kid}"
    uid = conn.cookies.get(COOKIE_NAME)
    if uid and _COOKIE_OK.match(uid):
        return f"browser:{uid}"
    return "anonymous"


def api_owner_of(conn: HTTPConnection) -> str:
    """The owner for the plain OpenAI HTTP routes: the API key, else "anonymous" (browser cookies
    are ignored there: SDKs and curl keep none or mint a new one per request, which would make every
    request its own owner). The web UI's session routes and the WebSocket use owner_of."""
    kid = (conn.scope.get("state") or {}).get(SCOPE_KEY_ID)
    return f"key:{kid}" if kid else "anonymous"


def rate_key_of(conn: HTTPConnection) -> str:
    """Whom rate limits count against: the API key, else the client address (cookies are free)."""
    kid = (conn.scope.get("state") or {}).get(SCOPE_KEY_ID)
    if kid:
        return f"key:{kid}"
    client = conn.client
    return f"ip:{client.host if client else 'unknown'}"


def cache_salt(state, owner: str) -> str:
    """HMAC-SHA256(session_secret, owner), hex: one owner's cached prefixes never serve another."""
    return hmac.new(state.session_secret, owner.encode("utf-8"), hashlib.sha256).hexdigest()

