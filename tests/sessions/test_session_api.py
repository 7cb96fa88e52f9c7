"""The session REST API end to end through the ASGI app: ownership, turns, usage, export/import, Redis."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from chatserve.server.sessions import RedisSessionStore
from session_fakes import ScriptedChat, make_app

pytestmark = pytest.mark.timeout(60)
JSON = {"content-type": "application/json"}


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_chunks(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert text.rstrip().endswith("data: [DONE]")
    return out


async def say(c: httpx.AsyncClient, sid: str, content: str | None = None, **kw) -> list[dict]:
    body = {"stream": True, **kw}
    if content is not None:
        body["content"] = content
    r = await c.post(f"/v1/sessions/{sid}/messages", json=body)
    assert r.status_code == 200, r.text
    return sse_chunks(r.text)


async def test_cookie_identity_and_owner_isolation():
    app = make_app(ScriptedChat())
    async with client(app) as alice, client(app) as bob:
        r = await alice.post("/v1/sessions", json={"title": "alice's"})
        assert r.status_code == 201
        sc = r.headers["set-cookie"]
        assert "chatserve_uid=" in sc and "HttpOnly" in sc and "SameSite=Lax" in sc
        uid = sc.split("chatserve_uid=")[1].split(";")[0]
        assert len(uid) >= 32                                   # 24 random bytes = 192 bits
        sid = r.json()["id"]
        assert len(sid) >= 22
        assert (await alice.get(f"/v1/sessions/{sid}")).status_code == 200
        assert "set-cookie" not in (await alice.get("/v1/sessions")).headers   # kept, not renewed
        assert (await bob.get("/v1/sessions")).json()["data"] == []
        for method, url in (("GET", f"/v1/sessions/{sid}"), ("DELETE", f"/v1/sessions/{sid}"),
                            ("GET", f"/v1/sessions/{sid}/export")):
            assert (await bob.request(method, url)).status_code == 404
        assert (await bob.patch(f"/v1/sessions/{sid}", json={"title": "pwned"})).status_code == 404
        assert (await bob.post(f"/v1/sessions/{sid}/messages", json={"content": "hi"})).status_code == 404
        assert (await alice.get(f"/v1/sessions/{sid}")).json()["title"] == "alice's"


async def test_turns_store_replies_with_usage_regenerate_and_edit():
    chat = ScriptedChat(reply=lambda m: f"reply {sum(x['role'] == 'user' for x in m)} to {m[-1]['content']}")
    app = make_app(chat)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={"system_prompt": "Be brief.",
                                                   "params": {"temperature": 0.2}})).json()["id"]
        chunks = await say(c, sid, "hello there")
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch.get("choices"))
        assert text == "reply 1 to hello there"
        assert chunks[-1]["usage"]["prompt_tokens"] > 0
        req = chat.requests[-1]
        assert req["keep_warm"] is True and req["owner"].startswith("browser:")
        assert req["req"]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert req["req"]["temperature"] == 0.2
        await say(c, sid, "and again", temperature=0.7)
        assert chat.requests[-1]["req"]["temperature"] == 0.7
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert [m["role"] for m in s["messages"]] == ["user", "assistant"] * 2
        assert s["title"] == "hello there"
        u = s["messages"][3]["usage"]
        assert u["cached_tokens"] > 0 and u["prompt_tokens"] > u["cached_tokens"]
        assert u["ttft_s"] == 0.012 and u["tokens_per_s"] == 42.0 and u["completion_tokens"] > 0
        # regenerate the last reply: same history, new reply replaces the old one
        await say(c, sid, regenerate=True)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert len(s["messages"]) == 4 and s["messages"][3]["content"] == "reply 2 to and again"
        # edit the first user message and resend: everything after it is replaced
        await say(c, sid, "edited", replace_from=0)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert [m["content"] for m in s["messages"]] == ["edited", "reply 1 to edited"]
        # list is newest first with counts, not messages
        await c.post("/v1/sessions", json={"title": "newer"})
        lst = (await c.get("/v1/sessions")).json()["data"]
        assert [x["title"] for x in lst] == ["newer", "hello there"] and "messages" not in lst[0]
        assert lst[1]["num_messages"] == 2


async def test_validation_and_cross_origin_refusals():
    app = make_app(ScriptedChat())
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        bad = [({"params": {"nope": 1}}, 400), ({"title": 5}, 400), ({"params": {"temperature": "x"}}, 400)]
        for body, code in bad:
            assert (await c.patch(f"/v1/sessions/{sid}", json=body)).status_code == code
        assert (await c.post(f"/v1/sessions/{sid}/messages", json={})).status_code == 400
        assert (await c.post(f"/v1/sessions/{sid}/messages", json={"regenerate": True})).status_code == 400
        assert (await c.post(f"/v1/sessions/{sid}/messages",
                             json={"content": "x", "max_tokens": 0})).status_code == 400
        r = await c.post(f"/v1/sessions/{sid}/messages", content=b'{"content":"x"}',
                         headers={"content-type": "text/plain"})
        assert r.status_code == 415                               # no CORS-simple writes
        r = await c.post("/v1/sessions", json={}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403
        assert (await c.get("/v1/sessions/not-a-valid-id")).status_code == 404
        assert (await c.get(f"/v1/sessions/{sid}")).json()["messages"] == []   # failed turns left nothing


async def test_export_import_roundtrip():
    app = make_app(ScriptedChat())
    async with client(app) as c, client(app) as other:
        sid = (await c.post("/v1/sessions", json={"title": "trip", "system_prompt": "sp"})).json()["id"]
        await say(c, sid, "one")
        r = await c.get(f"/v1/sessions/{sid}/export")
        assert "attachment" in r.headers["content-disposition"]
        doc = r.json()
        assert doc["format"] == "chatserve.session.v2" and len(doc["messages"]) == 2
        r = await other.post("/v1/sessions/import", json=doc)
        assert r.status_code == 201
        new = r.json()
        assert new["id"] != sid and new["title"] == "trip" and new["system_prompt"] == "sp"
        assert [m["content"] for m in new["messages"]] == [m["content"] for m in doc["messages"]]
        assert new["messages"][1]["usage"] == doc["messages"][1]["usage"]
        v1 = {k: v for k, v in doc.items() if k != "tree"} | {"format": "chatserve.session.v1"}
        r = await other.post("/v1/sessions/import", json=v1)          # exports of the old format
        assert r.status_code == 201 and [m["content"] for m in r.json()["messages"]] == ["one", "echo: one"]
        bad = dict(v1, messages=[{"role": "tool", "content": "x"}])
        assert (await other.post("/v1/sessions/import", json=bad)).status_code == 400
        nodes = doc["tree"]["nodes"]
        for tree in ({"nodes": [{**nodes[0], "role": "tool"}]}, {"nodes": [nodes[1]]},
                     {"nodes": nodes, "active": "m_nope"}, {"nodes": [nodes[0], nodes[0]]}):
            assert (await other.post("/v1/sessions/import", json=dict(doc, tree=tree))).status_code == 400


async def test_cancel_stops_generation_and_keeps_partial_reply():
    chat = ScriptedChat(reply=lambda m: " ".join(["word"] * 200), delay_s=0.01)
    app = make_app(chat)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        task = asyncio.create_task(c.post(f"/v1/sessions/{sid}/messages", json={"content": "go"}))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if chat.active:
                break
        await asyncio.sleep(0.1)
        assert (await c.post(f"/v1/sessions/{sid}/messages", json={"content": "x"})).status_code == 409
        assert (await c.post(f"/v1/sessions/{sid}/cancel", json={})).json()["cancelled"] is True
        r = await task
        chunks = sse_chunks(r.text)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert chat.active == 0 and chat.aborted == 1
        m = (await c.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert m[-1]["role"] == "assistant" and m[-1]["finish_reason"] == "abort"
        assert 0 < len(m[-1]["content"].split()) < 200
        await say(c, sid, "next")                                 # the session is free again


async def test_sessions_survive_app_restart(redis_server):
    chat = ScriptedChat()
    app1 = make_app(chat, redis_url=redis_server.url)
    async with client(app1) as c:
        sid = (await c.post("/v1/sessions", json={"title": "kept"})).json()["id"]
        await say(c, sid, "remember me")
        cookie = c.cookies.get("chatserve_uid")
        assert (await c.get("/v1/sessions/status")).json() == {
            **(await c.get("/v1/sessions/status")).json(), "backend": "redis", "degraded": False}
    await app1.state.session_store.aclose()
    app2 = make_app(chat, redis_url=redis_server.url)             # a new process, same Redis
    async with client(app2) as c:
        c.cookies.set("chatserve_uid", cookie)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["title"] == "kept" and [m["content"] for m in s["messages"]] == ["remember me", "echo: remember me"]
    await app2.state.session_store.aclose()


async def test_redis_restart_mid_conversation_loses_nothing(redis_server):
    chat = ScriptedChat(delay_s=0.005)
    store = RedisSessionStore(redis_server.url, op_timeout_s=0.3, retry_interval_s=0.05)
    app = make_app(chat, store=store)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        await say(c, sid, "turn one")
        # Redis dies while a reply is streaming
        chat.reply = lambda m: "a reply that streams while redis goes away " * 3
        task = asyncio.create_task(say(c, sid, "turn two"))
        await asyncio.sleep(0.05)
        redis_server.stop()
        await task
        r = await c.get("/v1/sessions/status")
        assert r.json()["degraded"] is True and r.json()["pending_writes"] >= 1
        chat.reply = lambda m: f"echo: {m[-1]['content']}"
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"content": "turn three"})
        assert r.status_code == 200 and sse_chunks(r.text)
        r = await c.get(f"/v1/sessions/{sid}")
        assert len(r.json()["messages"]) == 6 and r.headers["x-chatserve-session-store"] == "degraded"
        redis_server.start()                                      # restarted empty
        for _ in range(100):
            await asyncio.sleep(0.05)
            st = (await c.get("/v1/sessions/status")).json()
            if not st["degraded"] and st["pending_writes"] == 0:
                break
        assert st["degraded"] is False
        cookie = c.cookies.get("chatserve_uid")
    await store.aclose()
    app2 = make_app(chat, redis_url=redis_server.url)
    async with client(app2) as c:
        c.cookies.set("chatserve_uid", cookie)
        msgs = (await c.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert [m["content"] for m in msgs if m["role"] == "user"] == ["turn one", "turn two", "turn three"]
        assert msgs[3]["content"].startswith("a reply that streams") and msgs[5]["content"] == "echo: turn three"
    await app2.state.session_store.aclose()


async def test_memory_store_status_says_not_persisted():
    app = make_app(ScriptedChat())
    async with client(app) as c:
        r = await c.get("/v1/sessions/status")
        assert r.json()["persistent"] is False and r.headers["x-chatserve-session-store"] == "memory"


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c.get("object") == "chat.completion.chunk" and c["choices"])


def test_turn_over_the_websocket_and_both_ways_to_stop_it():
    from starlette.testclient import TestClient
    chat = ScriptedChat(reply=lambda m: "tok " * 500, delay_s=0.005)
    with TestClient(make_app(chat)) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]

        def settled() -> dict:
            import time
            for _ in range(200):      # "cancelled" may go out just before the partial reply is saved
                s = c.get(f"/v1/sessions/{sid}").json()
                if not s["generating"]:
                    return s
                time.sleep(0.02)
            raise AssertionError("the turn did not end")

        with c.websocket_connect("/v1/ws") as ws:
            ws.send_json({"id": "a", "type": "session", "session_id": sid, "content": "short", "max_tokens": 3})
            frames = []
            while not frames or frames[-1]["type"] == "chunk":
                frames.append(ws.receive_json())
            assert frames[-1] == {"id": "a", "type": "done"}
            first = frames[0]["chunk"]
            assert first["object"] == "chatserve.turn" and first["session_id"] == sid and not first["replay"]
            assert _text([f["chunk"] for f in frames[:-1]]) == "tok tok tok"
            ws.send_json({"id": "b", "type": "session", "session_id": sid, "content": "long"})
            for _ in range(10):
                assert ws.receive_json()["type"] == "chunk"
            ws.send_json({"id": "b", "type": "cancel"})             # Stop, as the page sends it
            while (f := ws.receive_json())["type"] == "chunk":
                pass
            assert f == {"id": "b", "type": "cancelled"}
            assert settled()["messages"][3]["finish_reason"] == "abort" and chat.aborted == 1
            ws.send_json({"id": "c", "type": "session", "session_id": sid, "content": "again"})
            for _ in range(10):
                assert ws.receive_json()["type"] == "chunk"
            ws.send_json({"id": "s", "type": "session.cancel", "session_id": sid})    # Stop by session
            frames = [ws.receive_json() for _ in range(2)]
            while frames[-1]["type"] == "chunk" or frames[-1]["id"] != "c":
                frames.append(ws.receive_json())
            assert {"id": "s", "type": "done"} in frames and frames[-1] == {"id": "c", "type": "done"}
            ws.send_json({"id": "d", "type": "session", "session_id": "nope" * 8, "content": "x"})
            assert ws.receive_json()["status"] == 404
        s = settled()
        assert chat.active == 0 and chat.aborted == 2
        msgs = s["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * 3
        assert msgs[1]["finish_reason"] == "length" and msgs[3]["finish_reason"] == "abort"
        assert msgs[5]["finish_reason"] == "abort" and 0 < len(msgs[5]["content"].split()) < 500


async def test_a_frozen_redis_does_not_hold_up_the_chat(redis_server):
    import redis.asyncio as aioredis
    chat = ScriptedChat()
    store = RedisSessionStore(redis_server.url, op_timeout_s=0.2, retry_interval_s=0.05)
    app = make_app(chat, store=store)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        await say(c, sid, "one")
        r = aioredis.from_url(redis_server.url)
        freeze = asyncio.create_task(r.execute_command("DEBUG", "SLEEP", "3"))   # Redis stops answering
        await asyncio.sleep(0.05)
        await say(c, sid, "two")
        await say(c, sid, "three")
        assert not freeze.done()                                 # two turns while Redis is still frozen
        assert (await c.get("/v1/sessions/status")).json()["degraded"] is True
        await freeze
        await r.aclose()
        for _ in range(100):
            st = (await c.get("/v1/sessions/status")).json()
            if not st["degraded"] and st["pending_writes"] == 0:
                break
            await asyncio.sleep(0.05)
    await store.aclose()
    fresh = RedisSessionStore(redis_server.url)
    s = await fresh.get(chat.requests[-1]["owner"], sid)
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["one", "two", "three"]
    await fresh.aclose()


async def test_engine_refusal_before_the_first_token_keeps_the_question():
    from chatserve.server.errors import APIError

    class Busy(ScriptedChat):
        busy = True

        async def stream(self, state, req, **kw):
            if self.busy:
                raise APIError(503, "server overloaded", code="server_overloaded", retry_after=1)
            async for c in super().stream(state, req, **kw):
                yield c

    chat = Busy()
    app = make_app(chat)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"content": "are you there?"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
        msgs = (await c.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert [m["role"] for m in msgs] == ["user"]                 # the question is kept, no reply
        chat.busy = False
        await say(c, sid, regenerate=True)                           # Retry answers it
        msgs = (await c.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert [m["content"] for m in msgs] == ["are you there?", "echo: are you there?"]


async def test_store_cache_is_bounded_but_keeps_pending_writes(redis_server):
    from chatserve.server.sessions import Session, new_session_id
    store = RedisSessionStore(redis_server.url, cache_limit=3, op_timeout_s=0.2, retry_interval_s=5)
    made = [await store.create(Session(id=new_session_id(), owner="o")) for _ in range(3)]
    redis_server.stop()
    await store.update("o", made[0].id, lambda s: s.add_message({"role": "user", "content": "x"}))
    for _ in range(4):
        await store.create(Session(id=new_session_id(), owner="o"))
    st = store.status()
    assert st["cached_sessions"] <= 5 and st["pending_writes"] == 5
    assert (await store.get("o", made[0].id)).messages[0]["content"] == "x"   # pending: still here
    await store.aclose()


def test_foreign_origins_never_act_with_the_browser_identity():
    from starlette.testclient import TestClient
    chat = ScriptedChat()
    with TestClient(make_app(chat), base_url="http://chat.local") as c:
        sid = c.post("/v1/sessions", json={"title": "mine"}).json()["id"]
        uid = c.cookies.get("chatserve_uid")
        evil = {"origin": "http://chat.local:3000", "cookie": f"chatserve_uid={uid}"}
        r = c.get("/v1/sessions", headers=evil)                   # e.g. another app on this host
        assert r.json()["data"] == [] and "set-cookie" not in r.headers
        assert c.get("/v1/sessions", headers={"origin": "http://chat.local"}).json()["data"][0]["id"] == sid
        # cross-site WebSocket hijacking: the handshake itself is refused (ws.py's Origin check)
        from starlette.websockets import WebSocketDisconnect
        with pytest.raises(WebSocketDisconnect) as refused:
            with c.websocket_connect("/v1/ws", headers=evil) as ws:
                ws.send_json({"id": "x", "type": "session", "session_id": sid, "content": "leak?"})
        assert refused.value.code == 1008
        assert chat.started == 0
        assert [m for m in c.get(f"/v1/sessions/{sid}").json()["messages"]] == []


async def test_a_model_the_server_does_not_serve_is_refused_when_set_not_at_the_next_turn():
    chat = ScriptedChat()
    app = make_app(chat, model_names=("tiny-code",))
    async with client(app) as c:
        r = await c.post("/v1/sessions", json={"model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "'fake-model'" in r.json()["error"]["message"] and r.json()["error"]["param"] == "model"
        sid = (await c.post("/v1/sessions", json={"model": "fake-model"})).json()["id"]
        r = await c.patch(f"/v1/sessions/{sid}", json={"model": "nope", "title": "kept?"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["model"] == "fake-model" and s["title"] != "kept?"          # nothing of the PATCH applied
        r = await c.patch(f"/v1/sessions/{sid}", json={"model": "tiny-code"})    # another served name
        assert r.status_code == 200 and r.json()["model"] == "tiny-code"
        await say(c, sid, "hi")
        assert chat.requests[-1]["req"]["model"] == "tiny-code"
        doc = (await c.get(f"/v1/sessions/{sid}/export")).json()
        r = await c.post("/v1/sessions/import", json={**doc, "model": "elsewhere"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (await c.post("/v1/sessions/import", json=doc)).status_code == 201
