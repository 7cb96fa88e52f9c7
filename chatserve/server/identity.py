"""Who is asking: an owner string per request, and the per-owner prefix-cache salt.

"key:<sha256(key)[:16]>" when authenticated by API key, else "browser:<cookie>", else "anonymous"
(sessions), or for the prefix cache "client:<peer address>". Not authentication itself (see auth.py)
and not the cookie's issuance (the sessions module).

Why the peer address for keyless callers' caches: a cached prefix shows in `cached_tokens` and in the
time to first token, so whoever shares another caller's cache can read that caller's prompt 16 tokens
at a time. The isolation key must be something an attacker cannot choose: an `user` field, a header or
a fresh cookie are all chosen by the client (anyone can claim the victim's value, or one value for
every client), while the TCP peer address cannot be forged by a remote caller. X-Forwarded-For counts
only from proxies named by --forwarded-allow-ips (serve.py). Callers behind one NAT or one untrusted
proxy still share: give them API keys. Operator-marked system prompts stay shared
(shared_prompts.py); --share-prefix-cache shares everything.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    from chatserve.server.state import ServerState

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


def client_of(conn: HTTPConnection) -> str:
    """"client:<peer address>": the keyless caller as the connection shows it (see the module doc)."""
    client = conn.client
    return f"client:{client.host if client else 'unknown'}"


def api_owner_of(conn: HTTPConnection) -> str:
    """The prefix-cache owner for the plain OpenAI HTTP routes: the API key, else the client address
    (browser cookies are ignored there: SDKs and curl keep none or mint a new one per request)."""
    kid = (conn.scope.get("state") or {}).get(SCOPE_KEY_ID)
    return f"key:{kid}" if kid else client_of(conn)


def cache_owner_of(conn: HTTPConnection) -> str:
    """The prefix-cache owner for the WebSocket and the session turns: owner_of, except that a caller
    with neither key nor cookie is its client address instead of the shared "anonymous"."""
    owner = owner_of(conn)
    return client_of(conn) if owner == "anonymous" else owner


def rate_key_of(conn: HTTPConnection) -> str:
    """Whom rate limits count against: the API key, else the client address (cookies are free)."""
    kid = (conn.scope.get("state") or {}).get(SCOPE_KEY_ID)
    if kid:
        return f"key:{kid}"
    client = conn.client
    return f"ip:{client.host if client else 'unknown'}"


def cache_salt(state: ServerState, owner: str) -> str | None:
    """HMAC-SHA256(session_secret, owner), hex: one owner's cached prefixes never serve another.
    None (one cache for everyone) when the operator chose --share-prefix-cache."""
    if state.config.server.share_prefix_cache:
        return None
    return hmac.new(state.session_secret, owner.encode("utf-8"), hashlib.sha256).hexdigest()

