"""The choice between the Redis session store and the in-process one (kept apart from store.py, the
interface both stores import, so that no store module imports the module that imports it)."""
from __future__ import annotations

from typing import Any

from chatserve.server.sessions.memory_store import MemorySessionStore
from chatserve.server.sessions.redis_store import RedisSessionStore
from chatserve.server.sessions.store import SessionStore


def make_session_store(redis_url: str | None, **kw: Any) -> SessionStore:
    """Redis when a URL is given, else the in-process store."""
    if redis_url:
        return RedisSessionStore(redis_url, **kw)
    return MemorySessionStore()
