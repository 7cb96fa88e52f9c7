"""Branches, re-attachable turns, progress events and the schema migration (issue 19 items 2, 5, 6
server side; docs/sessions-api.md). Through the ASGI app and the real /v1/ws; Redis where stored
data matters."""
from __future__ import annotations

from types import SimpleNamespace

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from chatserve.server.sessions import RedisSessionStore, new_session_id
from chatserve.server.sessions import turns as turns_module
from chatserve.server.sessions.memory_store import MemorySessionStore
from session_fakes import ScriptedChat, make_app, served

pytestmark = pytest.mark.timeout(60)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def events(text: str) -> list[dict]:
    assert text.rstrip().endswith("data: [DONE]")
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def text_of(items: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in items
                   if c.get("object") == "chat.completion.chunk" and c.get("choices"))


async def turn(c: httpx.AsyncClient, sid: str, **body) -> list[dict]:
    r = await c.post(f"/v1/sessions/{sid}/messages", json=body)
    assert r.status_code == 200, r.text
    return events(r.text)


async def test_edit_and_regenerate_keep_versions_and_branches_switch():
    n = {"replies": 0}

    def reply(msgs):
        n["replies"] += 1
        return f"r{n['replies']} to {msgs[-1]['content']}"

    app = make_app(ScriptedChat(reply=reply))
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        ev = await turn(c, sid, content="q1")
        start = ev[0]
        assert start["object"] == "chatserve.turn" and start["replay"] is False
        await turn(c, sid, content="q2")
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert [m["content"] for m in s["messages"]] == ["q1", "r1 to q1", "q2", "r2 to q2"]
        assert s["messages"][1]["id"] == start["message_id"]
        assert s["messages"][0]["id"] == start["user_message_id"]
        assert all(m["versions"] == [m["id"]] and m["version"] == 0 for m in s["messages"])
        # regenerate: a second version of the last reply
        await turn(c, sid, regenerate=True)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        last = s["messages"][3]
        assert last["content"] == "r3 to q2" and len(last["versions"]) == 2 and last["version"] == 1
        old_reply = last["versions"][0]
        # edit the first question: a second version of it, with its own reply; the old branch stays
        await turn(c, sid, content="q1 edited", replace_from=0)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert [m["content"] for m in s["messages"]] == ["q1 edited", "r4 to q1 edited"]
        first = s["messages"][0]
        assert len(first["versions"]) == 2 and first["version"] == 1
        # ◀: back to the first version of q1: its whole branch comes back, with the newest reply
        r = await c.post(f"/v1/sessions/{sid}/branch", json={"message_id": first["versions"][0]})
        assert r.status_code == 200
        assert [m["content"] for m in r.json()["messages"]] == ["q1", "r1 to q1", "q2", "r3 to q2"]
        r = await c.post(f"/v1/sessions/{sid}/branch", json={"message_id": old_reply})
        assert [m["content"] for m in r.json()["messages"]][-1] == "r2 to q2"
        assert r.json()["messages"][3]["version"] == 0
        assert (await c.get(f"/v1/sessions/{sid}")).json()["messages"] == r.json()["messages"]
        # the model answers the branch that is shown
        await turn(c, sid, content="q3")
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert [m["content"] for m in s["messages"]][-2:] == ["q3", "r5 to q3"]
        assert [m["content"] for m in s["messages"]][:4] == ["q1", "r1 to q1", "q2", "r2 to q2"]
        # edit by id works like replace_from
        await turn(c, sid, content="q3 again", edit_id=s["messages"][4]["id"])
        assert (await c.get(f"/v1/sessions/{sid}")).json()["messages"][4]["versions"][0] == s["messages"][4]["id"]
        # errors
        r = await c.post(f"/v1/sessions/{sid}/branch", json={"message_id": "m_nope"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "message_not_found"
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"content": "x", "edit_id": "m_nope"})
        assert r.status_code == 400
        assert (await c.post(f"/v1/sessions/{new_session_id()}/branch",
                             json={"message_id": first["id"]})).status_code == 404
        # export / import keeps every version
        doc = (await c.get(f"/v1/sessions/{sid}/export")).json()
        r = await c.post("/v1/sessions/import", json=doc)
        assert r.status_code == 201
        imported = r.json()
        assert [m["content"] for m in imported["messages"]] == [
            m["content"] for m in (await c.get(f"/v1/sessions/{sid}")).json()["messages"]]
        assert [len(m["versions"]) for m in imported["messages"]] == [2, 1, 1, 2, 2, 1]


async def _wait(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_turn_outlives_its_connection_and_can_be_reattached_over_sse(redis_server):
    words = [f"w{i}" for i in range(150)]
    chat = ScriptedChat(reply=lambda m: " ".join(words), delay_s=0.02)
    store = RedisSessionStore(redis_server.url)
    app = make_app(chat, store=store)
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        seen: list[dict] = []

        async def first_reader() -> None:          # a page that reads a few chunks, then is closed
            async with c.stream("POST", f"/v1/sessions/{sid}/messages", json={"content": "go"}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen.append(json.loads(line[6:]))
                    if len(text_of(seen).split()) >= 5:
                        return

        await first_reader()                        # the connection is gone
        assert chat.active == 1 and chat.aborted == 0
        # the partial reply is stored (about once a second) and the session says it is generating
        async def partial_saved() -> bool:
            s = (await c.get(f"/v1/sessions/{sid}")).json()
            return len(s["messages"]) == 2 and len(s["messages"][1]["content"].split()) >= 5
        await _wait(partial_saved)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["generating"] is True and s["turn"]["message_id"] == s["messages"][1]["id"]
        assert s["messages"][1]["status"] == "generating" and s["messages"][1]["finish_reason"] is None
        # another replica reading Redis sees the partial reply too
        other = RedisSessionStore(redis_server.url)
        stored = await other.get(chat.requests[-1]["owner"], sid)
        assert stored.messages[1]["content"].startswith("w0 w1 w2 w3 w4") and stored.turn_live()
        await other.aclose()
        # re-attach: the turn event, one chunk with everything so far, then the live rest
        r = await c.post(f"/v1/sessions/{sid}/attach", json={})
        assert r.status_code == 200
        ev = events(r.text)
        assert ev[0]["object"] == "chatserve.turn" and ev[0]["replay"] is True
        assert ev[0]["message_id"] == s["messages"][1]["id"]
        replay = ev[1]["choices"][0]["delta"]["content"]
        assert replay.startswith("w0 w1 w2 w3 w4")
        assert text_of(ev) == " ".join(words)                         # replay + live = the whole reply
        assert ev[-1]["usage"]["completion_tokens"] == 150
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["generating"] is False and s["turn"] is None
        assert s["messages"][1]["content"] == " ".join(words) and s["messages"][1]["finish_reason"] == "stop"
        assert "status" not in s["messages"][1] and chat.aborted == 0
        r = await c.post(f"/v1/sessions/{sid}/attach", json={})       # nothing running now
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_active_turn"
    await store.aclose()


class GatedStore(MemorySessionStore):
    """The memory store, except that updates wait while `gate` is clear, and each records how it ended."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.begun = 0
        self.ended: list[str] = []

    async def update(self, owner, sid, fn):
        self.begun += 1
        try:
            await self.gate.wait()
            out = await super().update(owner, sid, fn)
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        self.ended.append("done")
        return out


async def test_stop_during_a_partial_save_lets_that_write_finish_before_the_reply_is_stored(monkeypatch):
    """A partial save cut off mid-write can still land in Redis behind the store's back and then win
    over the stopped reply; so Stop waits for it, and the stored reply is the text that was streamed."""
    monkeypatch.setattr(turns_module, "SAVE_EVERY_S", 0.0)      # a partial save on every tick with news
    chat = ScriptedChat(reply=lambda m: " ".join(f"w{i}" for i in range(400)), delay_s=0.01)
    store = GatedStore()
    app = make_app(chat, store=store)
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        seen: list[dict] = []
        stopped = False
        async with c.stream("POST", f"/v1/sessions/{sid}/messages", json={"content": "go"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen.append(json.loads(line[6:]))
                if not stopped and len(text_of(seen).split()) >= 5:
                    stopped = True
                    store.gate.clear()                       # the next partial save hangs in the store

                    async def save_waiting() -> bool:
                        return store.begun > len(store.ended)
                    await _wait(save_waiting)
                    assert (await c.post(f"/v1/sessions/{sid}/cancel", json={})).json()["cancelled"] is True
                    await asyncio.sleep(0.2)
                    store.gate.set()
        assert "cancelled" not in store.ended
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["messages"][1]["finish_reason"] == "abort" and s["generating"] is False
        assert s["messages"][1]["content"] == text_of(seen)


def test_reattach_over_the_websocket_after_the_socket_dropped_and_stop_ends_every_follower():
    from starlette.testclient import TestClient
    chat = ScriptedChat(reply=lambda m: "tok " * 400, delay_s=0.01)
    with TestClient(make_app(chat)) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        with c.websocket_connect("/v1/ws") as ws:
            ws.send_json({"id": "a", "type": "session", "session_id": sid, "content": "go"})
            for _ in range(8):
                assert ws.receive_json()["type"] == "chunk"
        # the socket dropped: the reply goes on
        assert c.get(f"/v1/sessions/{sid}").json()["generating"] is True
        with c.websocket_connect("/v1/ws") as ws1, c.websocket_connect("/v1/ws") as ws2:
            for ws in (ws1, ws2):
                ws.send_json({"id": "r", "type": "session.attach", "session_id": sid})
                f = ws.receive_json()
                assert f["type"] == "chunk" and f["chunk"]["object"] == "chatserve.turn" and f["chunk"]["replay"]
                assert ws.receive_json()["chunk"]["choices"][0]["delta"]["content"].startswith("tok tok")
            assert c.post(f"/v1/sessions/{sid}/cancel", json={}).json()["cancelled"] is True
            for ws in (ws1, ws2):
                frames = []
                while (f := ws.receive_json())["type"] == "chunk":
                    frames.append(f["chunk"])
                assert f == {"id": "r", "type": "done"}
                assert [ch["choices"][0]["finish_reason"] for ch in frames if ch.get("choices")][-1] == "abort"
            ws1.send_json({"id": "x", "type": "session.attach", "session_id": sid})
            assert ws1.receive_json()["status"] == 404
        s = c.get(f"/v1/sessions/{sid}").json()
        assert s["generating"] is False and s["messages"][1]["finish_reason"] == "abort"
        assert 0 < len(s["messages"][1]["content"].split()) < 400 and chat.aborted == 1


class ProgressEngine:
    """Stands in for AsyncEngine.progress: queued (3, 2, 1), then prefill in steps, then decoding."""

    def __init__(self) -> None:
        self.script = ([{"phase": "queued", "queue_position": p} for p in (3, 2, 1)]
                       + [{"phase": "prefill", "prefill_done": d, "prefill_total": 300, "cached_tokens": 64}
                          for d in (64, 192)])
        self.calls = 0

    def progress(self, request_id: str) -> dict | None:
        self.calls += 1
        return self.script.pop(0) if self.script else None


async def test_progress_events_come_before_the_first_token():
    chat = ScriptedChat(reply=lambda m: "hello there")
    gate = asyncio.Event()
    orig = chat.stream

    async def slow_start(state, req, **kw):        # the first token waits until progress is reported
        agen = orig(state, req, **kw)
        yield await agen.__anext__()               # the role chunk (admitted)
        await gate.wait()
        async for x in agen:
            yield x

    chat.stream = slow_start
    app = make_app(chat)
    engine = ProgressEngine()
    # the turn's model, loaded, with this engine (the registry's peek is what turns read progress from)
    app.state.chatserve.models.peek = lambda name: SimpleNamespace(engine=engine) if name == "fake-model" else None
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]

        async def release() -> None:
            while engine.script:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            gate.set()

        rel = asyncio.create_task(release())
        ev = await turn(c, sid, content="hi")
        await rel
        prog = [e for e in ev if e.get("object") == "chatserve.turn.progress"]
        assert [p.get("queue_position") for p in prog if p["phase"] == "queued"] == [3, 2, 1]
        assert [p["prefill_done"] for p in prog if p["phase"] == "prefill"] == [64, 192]
        assert all(p["turn_id"] == ev[0]["id"] for p in prog)
        first_text = next(i for i, e in enumerate(ev) if text_of([e]))
        assert max(ev.index(p) for p in prog) < first_text
        assert text_of(ev) == "hello there"


async def test_progress_from_the_real_scheduler():
    from chatserve.config import SchedulerConfig
    from chatserve.core.kv_cache_manager import KVCacheManager
    from chatserve.core.request import Request, SamplingParams
    from chatserve.core.scheduler import Scheduler
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
                      KVCacheManager(64, 16), max_model_len=1024)
    for i in range(3):
        sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=list(range(1, 201)),
                                  params=SamplingParams(max_tokens=4)))
    assert [sched.progress(f"r{i}") for i in range(3)] == [
        {"phase": "queued", "queue_position": i} for i in (1, 2, 3)]
    sched.schedule()                                   # r0 admitted: its first 64-token chunk
    p = sched.progress("r0")
    assert p["phase"] == "prefill" and p["prefill_total"] == 200 and p["prefill_done"] <= 64
    assert sched.progress("r1") == {"phase": "queued", "queue_position": 1}
    assert sched.progress("nope") is None


async def test_data_in_the_old_schema_reads_after_the_upgrade(redis_server):
    """A session written by the previous release (flat messages, no schema field) reads, branches and
    is written back in the new schema."""
    r = aioredis.from_url(redis_server.url, decode_responses=True)
    app = make_app(ScriptedChat(), redis_url=redis_server.url)
    async with client(app) as c:
        await c.get("/v1/sessions")
        owner = "browser:" + c.cookies.get("chatserve_uid")
        sid = new_session_id()
        now = time.time()
        v1 = {"id": sid, "owner": owner, "title": "from v1", "created": now, "updated": now, "model": None,
              "system_prompt": "sp", "params": {"temperature": 0.5}, "rev": 3, "messages": [
                  {"role": "user", "content": "old q", "created": now},
                  {"role": "assistant", "content": "old a", "created": now, "finish_reason": "stop",
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]}
        store = app.state.session_store
        await r.hset(f"chatserve:session:{sid}", mapping={"rev": 3, "owner": owner, "updated": repr(now),
                                                          "data": json.dumps(v1)})
        await r.zadd(store._owner_key(owner), {sid: now})
        lst = (await c.get("/v1/sessions")).json()["data"]
        assert [(x["title"], x["num_messages"]) for x in lst] == [("from v1", 2)]
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert [m["content"] for m in s["messages"]] == ["old q", "old a"]
        assert s["messages"][1]["usage"]["prompt_tokens"] == 5 and s["params"] == {"temperature": 0.5}
        ids = [m["id"] for m in s["messages"]]
        assert (await c.get(f"/v1/sessions/{sid}")).json()["messages"][1]["id"] == ids[1]   # stable
        await turn(c, sid, regenerate=True)
        s = (await c.get(f"/v1/sessions/{sid}")).json()
        assert s["messages"][1]["versions"] == [ids[1], s["messages"][1]["id"]]
        stored = json.loads(await r.hget(f"chatserve:session:{sid}", "data"))
        assert stored["schema"] == 2 and len(stored["nodes"]) == 3 and "messages" not in stored
    await app.state.session_store.aclose()
    await r.aclose()
