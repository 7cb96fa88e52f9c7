"""The session store interface and session ids.

What the routes and the turn service need from a store; the stores themselves are in
memory_store.py and redis_store.py. No HTTP here.
"""
from __future__ import annotations

import re
import secrets
import time
from typing import Any, Callable, Protocol

from chatserve.server.sessions.session import Session

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_-]{22,64}$")   # token_urlsafe(16) is 22 chars = 128 bits
Mutation = Callable[[Session], None]


def new_session_id() -> str:
    """An unguessable id: 144 random bits, URL-safe, never contains ':' (so it is safe inside keys)."""
    return secrets.token_urlsafe(18)


def valid_session_id(sid: str) -> bool:
    return bool(SESSION_ID_RE.match(sid))


class StoreUnavailable(Exception):
    """The store cannot serve this now (Redis down and the session is not cached, or the outbox is full)."""


class SessionStore(Protocol):
    """What the routes need. All methods are owner-checked: another owner's session reads as missing.

    `list` skips (and logs) records that cannot be read back, so one bad record never hides the rest.
    `status()` is for operators (logs, metrics); `public_status()` is what API callers may see.
    """

    persistent: bool

    async def create(self, session: Session) -> Session: ...
    async def get(self, owner: str, sid: str) -> Session | None: ...
    async def list(self, owner: str, limit: int = 100) -> list[Session]: ...
    async def update(self, owner: str, sid: str, fn: Mutation) -> Session | None: ...
    async def delete(self, owner: str, sid: str) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def describe(self) -> str: ...
    async def aclose(self) -> None: ...


def public_status(store: SessionStore) -> dict[str, Any]:
    """The store's state without internals (no error text, hosts or ports): for API callers."""
    st = store.status()
    return {k: st[k] for k in ("backend", "persistent", "degraded", "pending_writes") if k in st}


def touch(s: Session) -> None:
    s.updated = max(time.time(), s.updated)
    s.rev += 1
