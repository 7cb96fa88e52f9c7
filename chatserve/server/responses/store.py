"""Stored responses, for GET /v1/responses/{id} and previous_response_id: in Redis when the server has
--redis-url (beside the sessions, with their TTL), in process memory otherwise. Owner-scoped: another
owner's response reads as missing. A record is {"response": the public object, "history": the chain's chat
messages through this response's output}. Not the translation (inputs.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import Any, Protocol

log = logging.getLogger("chatserve.server")
NAMESPACE = "chatserve:response"
MAX_IN_MEMORY = 10_000
OP_TIMEOUT_S = 0.5


class ResponseStore(Protocol):
    async def get(self, owner: str, rid: str) -> dict | None: ...
    async def put(self, owner: str, rid: str, record: dict) -> None: ...
    async def delete(self, owner: str, rid: str) -> bool: ...


class MemoryResponseStore:
    """The newest MAX_IN_MEMORY records of this process."""

    def __init__(self, limit: int = MAX_IN_MEMORY) -> None:
        self._items: OrderedDict[str, tuple[str, dict]] = OrderedDict()
        self.limit = limit

    async def get(self, owner: str, rid: str) -> dict | None:
        hit = self._items.get(rid)
        return hit[1] if hit is not None and hit[0] == owner else None

    async def put(self, owner: str, rid: str, record: dict) -> None:
        self._items[rid] = (owner, record)
        self._items.move_to_end(rid)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    async def delete(self, owner: str, rid: str) -> bool:
        hit = self._items.get(rid)
        if hit is None or hit[0] != owner:
            return False
        del self._items[rid]
        return True


class RedisResponseStore:
    """`chatserve:response:{id}` → JSON {"owner", "record"} with the sessions' TTL. While Redis does not
    answer, records are kept (and read back) in memory, so a chain in progress goes on."""

    def __init__(self, url: str, ttl_s: int) -> None:
        self.url, self.ttl_s = url, int(ttl_s)
        self._client: Any = None
        self._local = MemoryResponseStore(limit=2048)

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis
            self._client = aioredis.Redis.from_url(self.url, socket_connect_timeout=OP_TIMEOUT_S,
                                                   socket_timeout=OP_TIMEOUT_S, decode_responses=True)
        return self._client

    async def _call(self, aw: Any) -> Any:
        try:
            return await asyncio.wait_for(aw, OP_TIMEOUT_S)
        except Exception as e:               # timeouts, connection errors: the local copy serves
            log.warning("response store: redis unavailable (%s)", e)
            return None

    async def get(self, owner: str, rid: str) -> dict | None:
        local = await self._local.get(owner, rid)
        if local is not None:
            return local
        raw = await self._call(self._redis().get(f"{NAMESPACE}:{rid}"))
        if not raw:
            return None
        doc = json.loads(raw)
        return doc["record"] if doc.get("owner") == owner else None

    async def put(self, owner: str, rid: str, record: dict) -> None:
        await self._local.put(owner, rid, record)
        await self._call(self._redis().set(f"{NAMESPACE}:{rid}", json.dumps({"owner": owner, "record": record}),
                                           ex=self.ttl_s))

    async def delete(self, owner: str, rid: str) -> bool:
        found = await self.get(owner, rid) is not None
        if found:
            await self._local.delete(owner, rid)
            await self._call(self._redis().delete(f"{NAMESPACE}:{rid}"))
        return found


def make_response_store(redis_url: str | None) -> ResponseStore:
    if redis_url:
        from chatserve.server.sessions.redis_store import DEFAULT_TTL_S
        return RedisResponseStore(redis_url, DEFAULT_TTL_S)
    return MemoryResponseStore()
