"""docker/haproxy.cfg for real (Debian's haproxy) in front of two fake replicas on loopback ports:
session affinity by path, header and cookie; round-robin without a session; fallback when one dies.

The full topology with real chatserve replicas and Redis is test_topology.py.
"""
from __future__ import annotations

import secrets
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy_run import CFG, Proxy, free_port, haproxy_exe, proxy_env

pytestmark = pytest.mark.skipif(haproxy_exe() is None, reason="haproxy not installed (apt-get install haproxy)")


class Replica:
    def __init__(self, name: str) -> None:
        self.name, self.port, self.hits, self.draining = name, free_port(), 0, False

        async def any_path(request: Request) -> JSONResponse:
            if self.draining:  # what chatserve answers after SIGTERM: /ready and new requests 503
                return JSONResponse({"error": {"message": "draining", "type": "unavailable"}},
                                    status_code=503, headers={"Retry-After": "1"})
            if request.url.path != "/ready":
                self.hits += 1
            return JSONResponse({"replica": self.name})

        app = Starlette(routes=[Route("/{p:path}", any_path, methods=["GET", "POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def kill(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


@pytest.fixture
def topo(tmp_path):
    reps = [Replica("A"), Replica("B")]
    proxy = Proxy([f"127.0.0.1:{r.port}" for r in reps], tmp_path / "haproxy.log")
    try:
        proxy.wait_states({"replica1": "UP", "replica2": "UP"})
        yield reps, proxy
    finally:
        proxy.stop()
        for r in reps:
            r.kill()


def _who(c: httpx.Client, path: str, **kw) -> str:
    r = c.post(path, json={}, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["x-chatserve-replica"] in ("replica1", "replica2")
    return r.json()["replica"]


def test_config_is_valid_for_loopback():
    env = proxy_env(free_port(), free_port(), ["127.0.0.1:1", "127.0.0.1:2"])
    r = subprocess.run([haproxy_exe(), "-c", "-f", str(CFG)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_affinity_by_path_header_cookie_and_round_robin(topo):
    _, proxy = topo
    owners: dict[str, str] = {}
    with httpx.Client(base_url=proxy.url, timeout=10) as c:
        for i in range(16):
            sid = secrets.token_urlsafe(18)
            seen = {_who(c, f"/v1/sessions/{sid}/messages") for _ in range(3)}
            seen.add(_who(c, f"/v1/sessions/{sid}"))
            seen.add(_who(c, "/v1/chat/completions", headers={"X-Session-Id": sid}))
            with httpx.Client(base_url=proxy.url, timeout=10, cookies={"chatserve_uid": sid}) as cc:
                seen.add(_who(cc, "/v1/chat/completions"))
            assert len(seen) == 1, (sid, seen)  # one key, one replica, however it is carried
            owners[sid] = seen.pop()
        assert set(owners.values()) == {"A", "B"}  # the hash spreads sessions over both
    with httpx.Client(base_url=proxy.url, timeout=10) as c:
        plain = [_who(c, "/v1/chat/completions") for _ in range(8)]
        assert c.get("/metrics").status_code == 404  # not published through the proxy
    assert plain.count("A") >= 2 and plain.count("B") >= 2, plain  # no key: spread, not pinned
    with httpx.Client(base_url=proxy.url, timeout=10, cookies={"chatserve_uid": "u" * 32}) as c:
        # short path words are not session ids: the sessions WebSocket/status follow the browser cookie
        by_cookie = {_who(c, p) for p in ("/v1/ws", "/v1/sessions/status", "/v1/models")}
        assert len(by_cookie) == 1
        # the cookie outranks the path: a browser's WebSocket and SSE turns share one replica
        assert {_who(c, f"/v1/sessions/{secrets.token_urlsafe(18)}/messages") for _ in range(6)} == by_cookie
        # an explicit header outranks both
        hdr = {_who(c, "/v1/sessions/x/messages", headers={"X-Session-Id": s}) for s in owners}
        assert hdr == {"A", "B"}


def test_fallback_when_a_replica_dies(topo):
    reps, proxy = topo
    with httpx.Client(base_url=proxy.url, timeout=10) as c:
        sids = [secrets.token_urlsafe(18) for _ in range(12)]
        owners = {s: _who(c, f"/v1/sessions/{s}/messages") for s in sids}
        moved = [s for s, o in owners.items() if o == "A"]
        kept = [s for s, o in owners.items() if o == "B"]
        assert moved and kept
        reps[0].kill()
        # before the health check notices: retried on the other replica, not failed
        for s in moved:
            assert _who(c, f"/v1/sessions/{s}/messages") == "B"
        proxy.wait_states({"replica1": "DOWN", "replica2": "UP"}, timeout=10)
        for s in owners:
            assert _who(c, f"/v1/sessions/{s}/messages") == "B"


def test_draining_replica_hands_over_at_once(topo):
    reps, proxy = topo
    with httpx.Client(base_url=proxy.url, timeout=10) as c:
        sids = [secrets.token_urlsafe(18) for _ in range(12)]
        owners = {s: _who(c, f"/v1/sessions/{s}/messages") for s in sids}
        reps[1].draining = True
        # its 503 is retried on the other replica: no client sees it, even before the health check
        assert {_who(c, f"/v1/sessions/{s}/messages") for s in sids} == {"A"}
        proxy.wait_states({"replica1": "UP", "replica2": "DOWN"}, timeout=10)
        reps[1].draining = False
        proxy.wait_states({"replica1": "UP", "replica2": "UP"}, timeout=10)
        # back up: the same sessions return to the same replicas (consistent hashing)
        assert {s: _who(c, f"/v1/sessions/{s}/messages") for s in sids} == owners
