"""The response store: owner scoping in memory and in a real Redis (where a restarted server still finds
the chain), and the in-memory copy that keeps a chain going while Redis does not answer."""
from __future__ import annotations

import pytest

from chatserve.server.responses.store import MemoryResponseStore, RedisResponseStore

REC = {"response": {"id": "resp_1", "output": []}, "history": [{"role": "user", "content": "hi"}]}


async def _owner_scoped(store) -> None:
    await store.put("key:a", "resp_1", REC)
    assert await store.get("key:a", "resp_1") == REC
    assert await store.get("key:b", "resp_1") is None
    assert await store.delete("key:b", "resp_1") is False
    assert await store.delete("key:a", "resp_1") is True
    assert await store.get("key:a", "resp_1") is None


async def test_memory_store():
    await _owner_scoped(MemoryResponseStore())
    small = MemoryResponseStore(limit=2)
    for i in range(3):
        await small.put("o", f"r{i}", REC)
    assert await small.get("o", "r0") is None and await small.get("o", "r2") == REC


async def test_redis_store(redis_server):
    await _owner_scoped(RedisResponseStore(redis_server.url, ttl_s=60))
    a = RedisResponseStore(redis_server.url, ttl_s=60)
    await a.put("key:a", "resp_2", REC)
    fresh = RedisResponseStore(redis_server.url, ttl_s=60)          # another process: from Redis itself
    assert await fresh.get("key:a", "resp_2") == REC
    assert await fresh.get("key:b", "resp_2") is None


async def test_redis_down_keeps_the_local_copy():
    store = RedisResponseStore("redis://127.0.0.1:1/0", ttl_s=60)     # nothing listens there
    await store.put("o", "resp_3", REC)
    assert await store.get("o", "resp_3") == REC
    assert await store.get("o", "resp_4") is None
    pytest.importorskip("redis")
