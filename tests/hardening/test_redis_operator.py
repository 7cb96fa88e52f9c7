"""Operator papercuts with Redis (issue 23): rate limits hold across replicas on one real Redis, and a
wrong password or an unreachable Redis shows at startup, degrades `/ready` with the reason, and heals
by itself when Redis comes back."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import httpx
import pytest
from hardening_support import away_from_a_minute_boundary, free_port, start_fake_server

from chatserve.server.redis_check import RedisCheck

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis]
PASSWORD = "operator-test-pw"


def _redis_with_password(port: int) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not found: apt-get install -y redis-server")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--requirepass", PASSWORD], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def test_rate_limit_holds_across_two_replicas_on_one_redis(redis_server):
    a = start_fake_server(redis_url=redis_server.url, rate_limit_rpm=3)
    b = start_fake_server(redis_url=redis_server.url, rate_limit_rpm=3)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        away_from_a_minute_boundary()
        codes = [httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=10).status_code
                 for srv in (a, b, a, b, a)]
        # 3 per minute for this client in all: two processes must not give it 2 × 3
        assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429], codes
        r = httpx.post(b.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= float(r.headers["retry-after"]) <= 60
    finally:
        a.stop()
        b.stop()


def test_wrong_password_is_reported_at_startup():
    port = free_port()
    proc = _redis_with_password(port)
    try:
        bad = RedisCheck(f"redis://:wrong-{PASSWORD}@127.0.0.1:{port}/0")
        assert bad.check_sync() is False
        line = bad.banner_line()
        assert "DEGRADED" in line and "authentication failed" in line and PASSWORD not in line
        assert bad.ready_info() == {"redis": "redis authentication failed"}
        good = RedisCheck(f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
        assert good.check_sync() is True and "connected, authenticated" in good.banner_line()
    finally:
        _stop(proc)


def test_unreachable_redis_degrades_ready_then_recovers_by_itself():
    port = free_port()
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    srv = start_fake_server(redis_url=url)
    proc = None
    try:
        deadline = time.time() + 20
        while True:
            r = httpx.get(srv.url + "/ready", timeout=10)
            if r.json().get("redis") == "redis unreachable" or time.time() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text        # still serving: completions work without Redis
        body = r.json()
        assert body["status"] == "degraded" and body["redis"] == "redis unreachable", body
        assert str(port) not in r.text and PASSWORD not in r.text     # no host, port or password
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert chat.status_code == 200

        proc = _redis_with_password(port)           # Redis comes back: no restart of the server
        deadline = time.time() + 30
        while time.time() < deadline:
            body = httpx.get(srv.url + "/ready", timeout=10).json()
            if body["status"] == "ready":
                break
            time.sleep(0.2)
        assert body["status"] == "ready", body
    finally:
        srv.stop()
        if proc is not None:
            _stop(proc)
