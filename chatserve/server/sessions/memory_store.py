"""Sessions in process memory: gone when the process exits. Used when no Redis URL is configured.

Not the interface (store.py) and not Redis (redis_store.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from chatserve.server.sessions.session import Session
from chatserve.server.sessions.store import Mutation, touch


class MemorySessionStore:
    """A bounded dict of sessions, least recently written dropped first."""

    persistent = False

    def __init__(self, max_sessions: int = 10_000) -> None:
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._max = max_sessions

    async def create(self, session: Session) -> Session:
        touch(session)
        self._by_id[session.id] = session.clone()
        while len(self._by_id) > self._max:          # oldest-touched first
            self._by_id.popitem(last=False)
        return session

    async def get(self, owner: str, sid: str) -> Session | None:
        s = self._by_id.get(sid)
        return s.clone() if s is not None and s.owner == owner else None

    async def list(self, owner: str, limit: int = 100) -> list[Session]:
        mine = [s for s in self._by_id.values() if s.owner == owner]
        mine.sort(key=lambda s: s.updated, reverse=True)
        return [s.clone() for s in mine[:limit]]

    async def update(self, owner: str, sid: str, fn: Mutation) -> Session | None:
        s = self._by_id.get(sid)
        if s is None or s.owner != owner:
            return None
        work = s.clone()
        fn(work)
        touch(work)
        self._by_id[sid] = work
        self._by_id.move_to_end(sid)
        return work.clone()

    async def delete(self, owner: str, sid: str) -> bool:
        s = self._by_id.get(sid)
        if s is None or s.owner != owner:
            return False
        del self._by_id[sid]
        return True

    def status(self) -> dict[str, Any]:
        return {"backend": "memory", "persistent": False, "degraded": False, "pending_writes": 0}

    def describe(self) -> str:
        return "sessions: in-process memory, NOT persisted (lost on restart; set --redis-url to keep them)"

    async def aclose(self) -> None:
        return None
