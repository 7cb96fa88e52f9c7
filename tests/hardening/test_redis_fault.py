"""Redis stopped and restarted under load, on a real `chatserve serve` (tiny model) with a real
redis-server (the redis_server fixture of tests/conftest.py): generation is unaffected and no chat
turn is lost, as a second server process reading the same Redis shows."""
from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from hardening_support import start_real_server, wait_kv_zero

pytestmark = pytest.mark.timeout(180)
KEY = "redis-fault-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _reply_of(text: str) -> str:
    out = ""
    assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            c = json.loads(line[6:])
            assert "error" not in c, c
            for ch in c.get("choices", []):
                out += ch.get("delta", {}).get("content") or ""
    return out


def test_redis_restart_under_load_loses_no_turn_and_generation_goes_on(tiny_model, tmp_path, redis_server):
    redis = redis_server                         # tests/conftest.py: a throwaway redis-server
    args = ("--model", tiny_model, "--kv-blocks", "256", "--max-model-len", "1024", "--api-key", KEY,
            "--redis-url", redis.url)
    srv = start_real_server(str(tmp_path), *args)
    try:
        said: dict[str, list[tuple[str, str]]] = {}
        plain_ok = plain_bad = 0
        phase = {"redis": "up"}

        async def conversation(c: httpx.AsyncClient, k: int) -> None:
            sid = (await c.post("/v1/sessions", json={"title": f"chat {k}"})).json()["id"]
            said[sid] = []
            for turn in range(6):
                q = f"conversation {k} turn {turn} while redis is {phase['redis']}"
                r = await c.post(f"/v1/sessions/{sid}/messages",
                                 json={"content": q, "stream": True, "max_tokens": 6, "temperature": 0})
                assert r.status_code == 200, r.text
                said[sid].append((q, _reply_of(r.text)))
                await asyncio.sleep(0.15)

        async def plain_load(c: httpx.AsyncClient, stop: asyncio.Event) -> None:
            nonlocal plain_ok, plain_bad
            while not stop.is_set():
                r = await c.post("/v1/completions", json={"prompt": "load", "max_tokens": 8, "ignore_eos": True})
                if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length":
                    plain_ok += 1
                else:
                    plain_bad += 1

        async def outage() -> None:
            await asyncio.sleep(0.6)
            phase["redis"] = "down"
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(1.5)
            await asyncio.to_thread(redis.start)           # restarted empty (no persistence)
            phase["redis"] = "back"

        async def run() -> dict:
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=srv.url, timeout=60, headers=AUTH) as c:
                load = [asyncio.create_task(plain_load(c, stop)) for _ in range(2)]
                await asyncio.gather(outage(), *[conversation(c, k) for k in range(4)])
                stop.set()
                await asyncio.gather(*load)
                for _ in range(100):                        # the outbox flushes once Redis is back
                    st = (await c.get("/v1/sessions/status")).json()
                    if not st.get("degraded") and not st.get("pending_writes"):
                        break
                    await asyncio.sleep(0.1)
                return st
        st = asyncio.run(run())
        assert st.get("degraded") is False and not st.get("pending_writes"), st
        assert plain_ok > 0 and plain_bad == 0, (plain_ok, plain_bad)
        assert wait_kv_zero(srv.url) == 0
        assert srv.stop() == 0
        # a new process reads the same Redis: every turn of every conversation is there
        srv = start_real_server(str(tmp_path), *args)
        for sid, turns in said.items():
            r = httpx.get(f"{srv.url}/v1/sessions/{sid}", headers=AUTH, timeout=10)
            assert r.status_code == 200, r.text
            msgs = [(m["role"], m["content"]) for m in r.json()["messages"]]
            want = [x for q, a in turns for x in (("user", q), ("assistant", a))]
            assert msgs == want
        n_down = sum(1 for t in said.values() for q, _ in t if "down" in q)
        assert n_down > 0, "no turn happened while Redis was down"
        print(f"redis restart: {sum(map(len, said.values()))} turns kept ({n_down} while down); "
              f"{plain_ok} plain completions, 0 failed")
    finally:
        srv.stop(signal.SIGKILL)
