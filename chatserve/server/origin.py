"""The one same-origin rule, for the WebSocket handshake (ws.py) and the browser edge (sessions/edge.py).

A request is same-origin when it names no Origin (not a browser), when its Origin's host:port is the Host
it was sent to (scheme http or https, default ports and case normalized), or when the operator trusts
that origin (--cors-origin; "*" trusts every one). "null", file: and other schemes are foreign. Pure
string work on the two header values; no starlette here.
"""
from __future__ import annotations

DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...] = ()) -> bool:
    """True when a request with these Origin and Host headers may act (see the module docstring)."""
    if origin is None:
        return True
    origin = origin.strip().rstrip("/").lower()
    if "*" in allowed or origin in {o.strip().rstrip("/").lower() for o in allowed}:
        return True
    host = (host or "").strip().lower()
    scheme, sep, netloc = origin.partition("://")
    if not sep or scheme not in DEFAULT_PORTS or not host:
        return False
    default = DEFAULT_PORTS[scheme]
    return netloc == host or netloc + default == host or netloc == host + default
