"""Issue 14 on the session routes: strict bodies and the OpenAI sampling rules (item 1), unreadable
records never take a list down (item 1), deletes survive a Redis blip (item 4), and no store
internals for key holders (item 8). Real Redis where Redis matters."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis

from chatserve.server.sessions import MemorySessionStore, RedisSessionStore, Session, new_session_id
from session_fakes import ScriptedChat, make_app

pytestmark = pytest.mark.timeout(60)
JSON = {"content-type": "application/json"}

# bodies JSON cannot represent (or the server must not accept), as raw bytes
BAD_VALUES = {
    "NaN": b"NaN",
    "Infinity": b"Infinity",
    "-Infinity": b"-Infinity",
    "1e400": b"1e400",
    "lone surrogate": b'"\\ud800"',
    "deep nesting": b"[" * 5000 + b"]" * 5000,
}


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def assert_openai_400(r: httpx.Response) -> None:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "code" in err and "param" in err


@pytest.mark.parametrize("name", list(BAD_VALUES))
async def test_every_session_route_parses_strictly(name):
    bad = BAD_VALUES[name]
    app = make_app(ScriptedChat())
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={"title": "good"})).json()["id"]
        bodies = [
            ("POST", "/v1/sessions", b'{"params": {"temperature": ' + bad + b"}}"),
            ("POST", "/v1/sessions", b'{"title": ' + bad + b"}"),
            ("PATCH", f"/v1/sessions/{sid}", b'{"params": {"top_p": ' + bad + b"}}"),
            ("PATCH", f"/v1/sessions/{sid}", b'{"title": ' + bad + b"}"),
            ("POST", "/v1/sessions/import",
             b'{"format": "chatserve.session.v1", "messages": [{"role": "user", "content": ' + bad + b"}]}"),
            ("POST", "/v1/sessions/import", b'{"params": {"temperature": ' + bad + b"}, \"messages\": []}"),
            ("POST", f"/v1/sessions/{sid}/messages", b'{"content": "hi", "temperature": ' + bad + b"}"),
            ("POST", f"/v1/sessions/{sid}/branch", b'{"message_id": ' + bad + b"}"),
        ]
        for method, url, body in bodies:
            assert_openai_400(await c.request(method, url, content=body, headers=JSON))
        r = await c.get("/v1/sessions")                        # nothing was stored, the list still works
        assert r.status_code == 200 and [s["title"] for s in r.json()["data"]] == ["good"]
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["params"] == {} and s["messages"] == [] and s["title"] == "good"


async def test_sampling_params_follow_the_openai_routes_rules():
    app = make_app(ScriptedChat())
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        for params in ({"temperature": 5}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0},
                       {"repetition_penalty": 0}, {"presence_penalty": 3}, {"stop": [""]},
                       {"seed": 2 ** 70}, {"temperature": True}):
            assert_openai_400(await c.patch(f"/v1/sessions/{sid}", json={"params": params}))
            assert_openai_400(await c.post("/v1/sessions", json={"params": params}))
            assert_openai_400(await c.post(f"/v1/sessions/{sid}/messages", json={"content": "x", **params}))
        assert_openai_400(await c.patch(f"/v1/sessions/{sid}", json={"params": {"logit_bias": {}}}))
        r = await c.patch(f"/v1/sessions/{sid}", json={"params": {"temperature": 2, "max_tokens": 7.0,
                                                                  "stop": "END"}})
        assert r.status_code == 200 and r.json()["params"] == {"temperature": 2, "max_tokens": 7,
                                                               "stop": ["END"]}
        assert (await c.get(f"/v1/sessions/{sid}")).json()["messages"] == []


async def _poison(store, owner: str) -> str:
    """A record stored before the fix: NaN in its params (what the old routes accepted)."""
    s = Session(id=new_session_id(), owner=owner, title="poisoned", params={"temperature": float("nan")})
    await store.create(s)
    return s.id


async def test_an_unrenderable_record_never_takes_the_list_down(caplog):
    store = MemorySessionStore()
    app = make_app(ScriptedChat(), store=store)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={"title": "fine"})).json()["id"]
        owner = (await store.get(_owner_of(store, sid), sid)).owner
        await _poison(store, owner)
        bad = Session(id=new_session_id(), owner=owner, title="\ud800")
        await store.create(bad)
        r = await c.get("/v1/sessions")
        assert r.status_code == 200 and [s["title"] for s in r.json()["data"]] == ["fine"]
        assert "cannot be rendered" in caplog.text
        r = await c.get(f"/v1/sessions/{bad.id}")                 # alone: an error, not a crash
        assert r.status_code == 500 and r.json()["error"]["code"] == "session_unreadable"


def _owner_of(store: MemorySessionStore, sid: str) -> str:
    return store._by_id[sid].owner


async def test_an_unreadable_redis_record_is_skipped(redis_server, caplog):
    store = RedisSessionStore(redis_server.url)
    app = make_app(ScriptedChat(), store=store)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={"title": "fine"})).json()["id"]
        r = aioredis.from_url(redis_server.url, decode_responses=True)
        owner = json.loads(await r.hget(f"chatserve:session:{sid}", "data"))["owner"]
        poisoned = await _poison(store, owner)
        broken = new_session_id()                                    # a record that is not even JSON
        await r.hset(f"chatserve:session:{broken}", mapping={"rev": 1, "owner": owner, "data": "{not json"})
        await r.zadd(store._owner_key(owner), {broken: 1e12})
        resp = await c.get("/v1/sessions")
        assert resp.status_code == 200 and [s["title"] for s in resp.json()["data"]] == ["fine"]
        assert (await c.get(f"/v1/sessions/{broken}")).status_code == 404
        assert (await c.get(f"/v1/sessions/{poisoned}")).status_code == 500
        await r.aclose()
    await store.aclose()


async def test_a_delete_survives_a_redis_blip_on_another_replica(redis_server):
    """Replica A has two chats cached; a Redis pause makes A mark it down; replica B deletes both (its
    commands wait out the pause); A then recovers, flushes its edit of one and resyncs what it knows.
    Both chats stay deleted."""
    a = RedisSessionStore(redis_server.url, op_timeout_s=0.2, retry_interval_s=1.0)
    b = RedisSessionStore(redis_server.url, op_timeout_s=5.0)
    cached = await a.create(Session(id=new_session_id(), owner="o", title="cached on A"))
    edited = await a.create(Session(id=new_session_id(), owner="o", title="edited on A"))
    kept = await a.create(Session(id=new_session_id(), owner="o", title="kept"))
    assert await a.get("o", cached.id) is not None
    admin = aioredis.from_url(redis_server.url)
    await admin.execute_command("CLIENT", "PAUSE", "600", "ALL")
    deletes = asyncio.gather(b.delete("o", cached.id), b.delete("o", edited.id))   # wait out the pause
    await a.update("o", kept.id, lambda x: setattr(x, "title", "kept, edited during the blip"))
    await a.update("o", edited.id, lambda x: setattr(x, "title", "edited during the blip"))
    assert a.status()["degraded"] and a.status()["pending_writes"] == 2
    assert await deletes == [True, True]
    assert a.status()["degraded"]                                    # A has not retried yet
    for _ in range(100):                                             # A recovers: flush + resync
        await asyncio.sleep(0.05)
        if not a.status()["degraded"] and a.status()["pending_writes"] == 0:
            break
    assert not a.status()["degraded"]
    fresh = RedisSessionStore(redis_server.url)
    assert await fresh.get("o", cached.id) is None and await fresh.get("o", edited.id) is None
    assert [x.title for x in await fresh.list("o")] == ["kept, edited during the blip"]
    assert [x.id for x in await a.list("o")] == [kept.id]
    await admin.aclose()
    for st in (a, b, fresh):
        await st.aclose()


async def test_store_internals_are_not_shown_to_key_holders(redis_server):
    store = RedisSessionStore(redis_server.url, op_timeout_s=0.2, retry_interval_s=5)
    app = make_app(ScriptedChat(), store=store, api_keys=("sk-test",))
    auth = {"authorization": "Bearer sk-test"}
    async with client(app) as c:
        c.headers.update(auth)
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        redis_server.stop()
        await c.patch(f"/v1/sessions/{sid}", json={"title": "while down"})
        lst = await c.get("/v1/sessions")
        assert lst.status_code == 200 and "store" not in lst.json()
        assert lst.headers["x-chatserve-session-store"] == "degraded"
        st = (await c.get("/v1/sessions/status")).json()
        assert st == {"backend": "redis", "persistent": True, "degraded": True, "pending_writes": 1}
        for text in (lst.text, json.dumps(st)):
            assert str(redis_server.port) not in text and "127.0.0.1" not in text and "Error" not in text
        assert store.status()["error"]                                 # operators still have it
    await store.aclose()
