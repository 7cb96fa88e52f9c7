"""The session store against a real redis-server: keys, TTL, owner index, CAS, outbox and recovery."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from chatserve.server.sessions import (MemorySessionStore, RedisSessionStore, Session, StoreUnavailable,
                                       new_session_id, valid_session_id)

pytestmark = pytest.mark.timeout(60)


def test_ids_are_unguessable_and_key_safe():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(valid_session_id(i) and len(i) >= 22 and ":" not in i for i in ids)
    assert not valid_session_id("abc") and not valid_session_id("x" * 30 + ":y")


async def _exercise(store) -> None:
    a = await store.create(Session(id=new_session_id(), owner="browser:a", title="first"))
    await asyncio.sleep(0.01)
    b = await store.create(Session(id=new_session_id(), owner="browser:a", title="second"))
    c = await store.create(Session(id=new_session_id(), owner="browser:b", title="theirs"))
    assert [s.title for s in await store.list("browser:a")] == ["second", "first"]
    assert await store.get("browser:b", a.id) is None              # another owner: missing
    assert await store.update("browser:b", a.id, lambda s: setattr(s, "title", "x")) is None
    await asyncio.sleep(0.01)
    s = await store.update("browser:a", a.id, lambda s: s.add_message({"role": "user", "content": "hi"}))
    assert s.messages[-1]["content"] == "hi" and s.rev == a.rev + 1
    assert [x.title for x in await store.list("browser:a")] == ["first", "second"]   # newest first
    assert not await store.delete("browser:b", b.id)
    assert await store.delete("browser:a", b.id)
    assert await store.get("browser:a", b.id) is None
    assert [x.id for x in await store.list("browser:b")] == [c.id]


async def test_memory_store_semantics():
    store = MemorySessionStore()
    await _exercise(store)
    assert store.status()["persistent"] is False
    assert "NOT persisted" in store.describe()


async def test_redis_store_semantics_keys_and_ttl(redis_server):
    store = RedisSessionStore(redis_server.url, ttl_s=3600)
    await _exercise(store)
    r = aioredis.from_url(redis_server.url, decode_responses=True)
    keys = await r.keys("*")
    assert keys and all(k.startswith("chatserve:session:") for k in keys)
    for k in keys:
        assert 0 < await r.ttl(k) <= 3600
    sess_keys = [k for k in keys if ":owner:" not in k]
    tombstones = [k for k in sess_keys if await r.hget(k, "deleted") == "1"]
    assert len(tombstones) == 1 and await r.hget(tombstones[0], "data") is None     # the deleted one
    data = json.loads(await r.hget(next(k for k in sess_keys if k not in tombstones), "data"))
    assert data["owner"].startswith("browser:") and data["schema"] == 2
    await r.aclose()
    await store.aclose()


async def test_concurrent_updates_from_two_processes_lose_nothing(redis_server):
    s1, s2 = RedisSessionStore(redis_server.url), RedisSessionStore(redis_server.url)
    sess = await s1.create(Session(id=new_session_id(), owner="o"))

    async def add(store, i):
        await store.update("o", sess.id, lambda s: s.add_message({"role": "user", "content": str(i)}))

    await asyncio.gather(*(add(s1 if i % 2 else s2, i) for i in range(20)))
    got = await s1.get("o", sess.id)
    assert sorted(int(m["content"]) for m in got.messages) == list(range(20))
    await s1.aclose()
    await s2.aclose()


async def test_outage_buffers_writes_and_recovers_after_data_loss(redis_server):
    store = RedisSessionStore(redis_server.url, op_timeout_s=0.3, retry_interval_s=0.05)
    keep = await store.create(Session(id=new_session_id(), owner="o", title="before"))
    redis_server.stop()
    # reads come from the local cache, writes queue; nothing raises on the chat path
    s = await store.update("o", keep.id, lambda s: s.add_message({"role": "user", "content": "during"}))
    assert s.messages[-1]["content"] == "during"
    assert store.status()["degraded"] and store.status()["pending_writes"] == 1
    assert (await store.get("o", keep.id)).messages[-1]["content"] == "during"
    await store.create(Session(id=new_session_id(), owner="o", title="made while down"))
    assert {x.title for x in await store.list("o")} == {"before", "made while down"}
    with pytest.raises(StoreUnavailable):                         # never cached here: honest 503
        await store.get("o", new_session_id())
    redis_server.start()                                          # empty: it had no persistence
    for _ in range(100):
        await asyncio.sleep(0.05)
        st = store.status()
        if not st["degraded"] and st["pending_writes"] == 0:
            break
    assert not store.status()["degraded"]
    fresh = RedisSessionStore(redis_server.url)                   # another process sees everything
    got = await fresh.get("o", keep.id)
    assert got is not None and got.messages[-1]["content"] == "during"
    assert {x.title for x in await fresh.list("o")} == {"before", "made while down"}
    await fresh.aclose()
    await store.aclose()


async def test_outbox_is_bounded(redis_server):
    store = RedisSessionStore(redis_server.url, op_timeout_s=0.2, retry_interval_s=5, outbox_limit=2)
    redis_server.stop()
    await store.create(Session(id=new_session_id(), owner="o"))
    await store.create(Session(id=new_session_id(), owner="o"))
    with pytest.raises(StoreUnavailable):
        await store.create(Session(id=new_session_id(), owner="o"))
    await store.aclose()
