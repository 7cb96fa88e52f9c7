"""The compose topology for real, without containers: two `chatserve serve` processes (tiny model,
small KV cache) behind HAProxy running docker/haproxy.cfg, sharing one password-protected Redis.

A session's turns land on one replica and hit its prefix cache; kill that replica (SIGKILL) and the
conversation continues on the other with its history read from Redis.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chatserve.bench import server_metrics
from chatserve.bench.sse_client import COMPLETED, make_client, stream_request
from proxy_run import ROOT, Proxy, free_port, haproxy_exe

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(300)]

PASSWORD = "topology-test-pw"


def _need() -> str | None:
    if haproxy_exe() is None:
        return "haproxy not installed"
    if shutil.which("redis-server") is None:
        return "redis-server not installed"
    return None


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    reason = _need()
    if reason:
        pytest.skip(reason)
    from chatserve.runtime.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("topo")
    model = make_tiny_model(tmp / "tiny")
    procs: list[subprocess.Popen] = []
    logs = []

    def spawn(args: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        f = open(tmp / log, "w")
        logs.append(f)
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, **(env or {})})
        procs.append(p)
        return p

    rport = free_port()
    spawn(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
           "--appendonly", "yes", "--dir", str(tmp), "--save", ""], "redis.log")
    redis_url = f"redis://:{PASSWORD}@127.0.0.1:{rport}/0"
    replicas = []
    for i in (1, 2):
        port = free_port()
        p = spawn([sys.executable, "-m", "chatserve.cli", "serve", "--model", model, "--port", str(port),
                   "--host", "127.0.0.1", "--redis-url", redis_url, "--kv-blocks", "96",
                   "--stats-interval", "0", "--drain-timeout", "5"], f"replica{i}.log",
                  env={"CHATSERVE_SESSION_SECRET": "shared-secret-of-both-replicas", "PYTHONPATH": str(ROOT)})
        replicas.append({"name": f"replica{i}", "port": port, "proc": p,
                         "url": f"http://127.0.0.1:{port}"})
    proxy = Proxy([f"127.0.0.1:{r['port']}" for r in replicas], tmp / "haproxy.log")
    try:
        proxy.wait_states({"replica1": "UP", "replica2": "UP"}, timeout=180)
    except Exception:
        for f in logs:
            f.flush()
        for r in replicas:
            print(Path(tmp / f"{r['name']}.log").read_text()[-3000:])
        proxy.stop()
        for p in procs:
            p.kill()
        raise
    yield {"proxy": proxy, "replicas": {r["name"]: r for r in replicas}, "tmp": tmp}
    proxy.stop()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
    for f in logs:
        f.close()


async def _hits(url: str) -> float:
    async with make_client(url) as c:
        m = await server_metrics.scrape(c)
    return server_metrics.lookup(m, "prefix_cache_hits_total") or 0.0


async def _turn(client: httpx.AsyncClient, sid: str, text: str):
    """One streamed session turn through the proxy: (replica that served it, StreamResult)."""
    served: list[str] = []

    async def note(resp: httpx.Response) -> None:
        served.append(resp.headers.get("x-chatserve-replica", "?"))

    client.event_hooks["response"] = [note]
    res = await stream_request(client, f"/v1/sessions/{sid}/messages",
                               {"content": text, "stream": True, "max_tokens": 6, "temperature": 0},
                               chat=True)
    client.event_hooks["response"] = []
    assert res.outcome == COMPLETED, (res.status, res.problems, res.error)
    return served[-1], res


async def _messages(url: str, sid: str, cookies) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, cookies=cookies, timeout=10) as c:
        r = await c.get(f"/v1/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()["messages"]


# Spellings of /metrics a client might send past the proxy; the replica decodes %XX before routing,
# so /%6detrics is /metrics there (issue 14 item 7).
METRICS_SPELLINGS = ["/metrics", "/%6detrics", "/%6D%65trics", "/%6d%65%74%72%69%63%73", "//metrics",
                     "///metrics", "/./metrics", "/x/../metrics", "/%2e/metrics", "/%2Fmetrics",
                     "/METRICS", "/Metrics", "/%4Detrics", "/metrics/", "/metrics?x=1", "/metrics;x"]


def _raw_get(port: int, path: str) -> tuple[int, str]:
    """GET with the path sent exactly as written (no client-side normalisation)."""
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def test_proxy_refuses_every_spelling_of_metrics(topology):
    proxy, reps = topology["proxy"], topology["replicas"]
    # the encoded form is a real bypass without the proxy: a replica serves its metrics for it
    status, text = _raw_get(reps["replica1"]["port"], "/%6detrics")
    assert status == 200 and "chatserve:" in text
    for path in METRICS_SPELLINGS:
        status, text = _raw_get(proxy.port, path)
        assert status == 404, (path, status)
        assert "chatserve:" not in text, path
    # everything else still passes
    assert _raw_get(proxy.port, "/health")[0] == 200
    assert _raw_get(proxy.port, "/v1/models")[0] == 200


async def test_session_affinity_prefix_hits_and_failover(topology):
    proxy, reps = topology["proxy"], topology["replicas"]
    system = "You are a careful assistant. " * 12
    async with make_client(proxy.url, timeout=120) as client:
        r = await client.get("/v1/sessions")          # the browser identity cookie comes first
        assert r.status_code == 200 and "chatserve_uid" in client.cookies
        r = await client.post("/v1/sessions", json={"title": "t", "system_prompt": system})
        assert r.status_code in (200, 201), r.text
        sid = r.json()["id"]
        home = r.headers["x-chatserve-replica"]
        other = "replica2" if home == "replica1" else "replica1"

        hits0 = await _hits(reps[home]["url"])
        served1, _ = await _turn(client, sid, "Tell me about paged attention in one line.")
        served2, res2 = await _turn(client, sid, "And about prefix caching?")
        assert served1 == served2 == home  # every request of the session on one replica
        # turn 2's prompt starts with turn 1's: the home replica's prefix cache served it
        assert await _hits(reps[home]["url"]) - hits0 >= 16
        if res2.cached_tokens is not None:
            assert res2.cached_tokens >= 16

        # the history is in Redis (read through the replica that never saw this session)
        deadline = time.time() + 20
        while len(await _messages(reps[other]["url"], sid, client.cookies)) < 4:
            assert time.time() < deadline, "turns never reached Redis"
            await asyncio.sleep(0.2)

        reps[home]["proc"].kill()                      # a crash, not a drain
        reps[home]["proc"].wait(timeout=10)
        served3, res3 = await _turn(client, sid, "Summarize what we said.")
        assert served3 == other
        # the new replica built the prompt from the Redis history: far longer than the new message
        assert res3.prompt_tokens is None or res3.prompt_tokens > res2.prompt_tokens
        msgs = await _messages(proxy.url, sid, client.cookies)
        assert [m["role"] for m in msgs if m["role"] != "system"] == ["user", "assistant"] * 3
        assert "paged attention" in msgs[0]["content"] or "paged attention" in msgs[1]["content"]
        proxy.wait_states({home: "DOWN", other: "UP"}, timeout=10)
