"""The compose stack for real: images built, `docker compose up`, and every promise of docs/deploy.md
checked through the proxy. Runs under `make test-deploy` (CHATSERVE_DEPLOY_STACK=1 and a Docker engine;
docker/local/ builds the images from a local Debian base where Docker Hub is out of reach).

Order matters: the tests share one stack and run top to bottom; the last one takes it down with -v.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from session_fakes import free_port

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "chatserve-stack-test"
REPLICAS = {"replica1": "chatserve-1", "replica2": "chatserve-2"}

# deselected (tests/conftest.py) unless CHATSERVE_DEPLOY_STACK=1: it runs under `make test-deploy`
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(2400)]


def _compose_bin() -> list[str]:
    exe = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")
    return [exe]


class Stack:
    """`docker compose` on this project with the local-image override, and HTTP helpers for the proxy."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "REDIS_PASSWORD": secrets.token_hex(16),
                    "CHATSERVE_SESSION_SECRET": secrets.token_hex(32), "CHATSERVE_PORT": str(self.port),
                    "CHATSERVE_API_KEYS": "", "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(8),
                    "COMPOSE_PROJECT_NAME": PROJECT}

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = [*_compose_bin(), "-f", str(ROOT / "docker-compose.yml"),
               "-f", str(ROOT / "docker/local/compose.local.yml"), *args]
        r = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} → {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def health(self) -> dict[str, str]:
        """service → health ("healthy", "starting", "", …) of the running containers."""
        out = self.compose("ps", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if len(rows) == 1 and isinstance(rows[0], list):
            rows = rows[0]
        return {r["Service"]: (r.get("Health") or r.get("State") or "") for r in rows}

    def wait_healthy(self, services: tuple[str, ...], timeout: float = 600) -> None:
        deadline, last = time.time() + timeout, {}
        while time.time() < deadline:
            last = self.health()
            if all(last.get(s) == "healthy" for s in services):
                return
            time.sleep(2)
        logs = self.compose("logs", "--tail", "60", check=False).stdout
        raise AssertionError(f"not healthy in {timeout}s: {last}\n{logs[-6000:]}")

    def wait_serving(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError("the proxy never served /v1/models")

    def wait_routed(self, timeout: float = 300) -> None:
        """Until the proxy routes to every replica: Docker's "healthy" comes first, then HAProxy needs
        its own checks (rise 2 at 1 s) and, after a restart, the replica's new address from DNS; a
        request in between gets HAProxy's 503 "No server is available"."""
        deadline, seen = time.time() + timeout, set()
        while time.time() < deadline:
            for i in range(16):
                try:
                    r = httpx.get(self.url + "/v1/models", headers={"X-Session-Id": f"route-{i:03d}"}, timeout=5)
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    seen.add(r.headers.get("x-chatserve-replica", ""))
            if set(REPLICAS) <= seen:
                return
            seen.clear()
            time.sleep(1)
        raise AssertionError(f"the proxy routed only to {sorted(seen)} in {timeout}s")

    def wait_back(self, services: tuple[str, ...]) -> None:
        """Containers healthy and both replicas taking requests through the proxy."""
        self.wait_healthy(services)
        self.wait_routed()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=300, **kw)


@pytest.fixture(scope="module")
def stack():
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers (make test-deploy starts one: docker/local/engine.sh)")
    subprocess.run(["bash", str(ROOT / "docker/local/build-images.sh")], check=True, timeout=3600)
    s = Stack()
    s.compose("down", "-v", check=False)
    try:
        s.compose("up", "-d", "--no-build")
        s.wait_back(("redis", "chatserve-1", "chatserve-2"))
        yield s
    finally:
        s.compose("down", "-v", check=False)


def _chat_stream(client: httpx.Client, headers: dict | None = None, max_tokens: int = 16) -> tuple[str, str, list]:
    """One streamed chat completion: (replica that served it, text, finish reasons)."""
    body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}]}
    text, reasons, done = "", [], False
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers.get("x-chatserve-replica", "")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                text += (ch.get("delta") or {}).get("content") or ""
                if ch.get("finish_reason"):
                    reasons.append(ch["finish_reason"])
    assert done, "stream ended without [DONE]"
    return replica, text, reasons


def _session(client: httpx.Client) -> str:
    assert client.get("/v1/sessions").status_code == 200          # identity cookie first
    r = client.post("/v1/sessions", json={"title": "stack", "system_prompt": "You are terse."})
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def _turn(client: httpx.Client, sid: str, text: str) -> str:
    """A streamed session turn; returns the replica that served it."""
    with client.stream("POST", f"/v1/sessions/{sid}/messages",
                       json={"content": text, "stream": True, "max_tokens": 8, "temperature": 0}) as r:
        assert r.status_code == 200, r.read()
        body = "".join(r.iter_text())
    assert "[DONE]" in body, body[-500:]
    return r.headers.get("x-chatserve-replica", "")


def _messages(client: httpx.Client, sid: str) -> list[dict]:
    r = client.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return [m for m in r.json()["messages"] if m["role"] != "system"]


def test_streamed_chat_completion(stack):
    with stack.client() as c:
        replica, text, reasons = _chat_stream(c)
    assert replica in REPLICAS and text.strip() and reasons in (["length"], ["stop"])


def test_websocket_session_turn(stack):
    from websockets.sync.client import connect

    with stack.client() as c:
        sid = _session(c)
        cookie = "; ".join(f"{k}={v}" for k, v in c.cookies.items())
    ws_url = stack.url.replace("http://", "ws://") + "/v1/ws"
    frames = []
    with connect(ws_url, additional_headers={"Cookie": cookie, "Origin": stack.url}, open_timeout=30) as ws:
        ws.send(json.dumps({"id": "t1", "type": "session", "session_id": sid, "content": "Hello there",
                            "max_tokens": 8, "temperature": 0}))
        while True:
            frame = json.loads(ws.recv(timeout=300))
            frames.append(frame)
            if frame.get("type") in ("done", "error", "cancelled"):
                break
    assert frames[-1]["type"] == "done", frames[-3:]
    assert any(f.get("type") == "chunk" for f in frames)


def test_affinity_and_failover_to_the_other_replica(stack):
    with stack.client() as c:
        sid = _session(c)
        first = _turn(c, sid, "My name is Ada.")
        assert _turn(c, sid, "What is my name?") == first, "a session's turns stay on one replica"
        stack.compose("kill", REPLICAS[first])                       # a crash, mid-conversation
        third = _turn(c, sid, "Say it once more.")
        assert third != first and third in REPLICAS
        msgs = _messages(c, sid)
        assert [m["role"] for m in msgs] == ["user", "assistant"] * 3, msgs
        assert msgs[0]["content"] == "My name is Ada."
    stack.compose("start", REPLICAS[first])
    stack.wait_back(("chatserve-1", "chatserve-2"))


def test_proxy_restarts_while_a_replica_is_down(stack):
    stack.compose("stop", "chatserve-2")
    stack.compose("restart", "proxy")
    stack.wait_serving(timeout=120)                  # it starts and serves from the replica that is up
    with stack.client() as c:
        assert {_chat_stream(c, {"X-Session-Id": f"s-{i:03d}"}, 2)[0] for i in range(6)} == {"replica1"}
    stack.compose("start", "chatserve-2")
    stack.wait_back(("chatserve-1", "chatserve-2"))
    deadline, seen = time.time() + 120, set()
    with stack.client() as c:
        while seen != set(REPLICAS) and time.time() < deadline:   # picked up again, no proxy restart
            seen |= {_chat_stream(c, {"X-Session-Id": f"s-{i:03d}"}, 1)[0] for i in range(12)}
    assert seen == set(REPLICAS)


def test_drain_on_stop_finishes_the_stream(stack):
    with stack.client() as c:
        # find a session key that lands on replica1
        key = next(k for k in (f"drain-{i}" for i in range(64))
                   if _chat_stream(c, {"X-Session-Id": k}, 1)[0] == "replica1")
        result: dict = {}

        def long_stream() -> None:
            result["out"] = _chat_stream(c, {"X-Session-Id": key}, 400)

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(1.0)
        stack.compose("stop", "chatserve-1")           # SIGTERM: stop admitting, let streams finish
        t.join(timeout=300)
    replica, text, reasons = result["out"]
    assert replica == "replica1" and text and reasons and reasons[0] in ("length", "stop")
    stack.compose("start", "chatserve-1")
    stack.wait_back(("chatserve-1", "chatserve-2"))


def test_sessions_survive_restarts_of_replicas_redis_and_the_stack(stack):
    with stack.client() as c:
        sid = _session(c)
        _turn(c, sid, "Remember the word lighthouse.")
        want = _messages(c, sid)
        assert len(want) == 2
        stack.compose("restart", "chatserve-1", "chatserve-2")
        stack.wait_back(("chatserve-1", "chatserve-2"))
        assert _messages(c, sid) == want
        stack.compose("restart", "redis")
        stack.wait_back(("redis", "chatserve-1", "chatserve-2"))
        assert _messages(c, sid) == want
        stack.compose("down")                           # volumes kept
        stack.compose("up", "-d", "--no-build")
        stack.wait_back(("redis", "chatserve-1", "chatserve-2"))
        assert _messages(c, sid) == want


def test_metrics_hidden_at_the_proxy(stack):
    with stack.client() as c:
        for path in ("/metrics", "/metrics?x=1"):
            assert c.get(path).status_code == 404, path


def _in_proxy(stack: Stack, script: str) -> str:
    """Run a shell snippet in the proxy container and return what it printed (exit codes of
    `compose exec` are not relied on: older engines do not pass them through)."""
    return stack.compose("exec", "-T", "proxy", "sh", "-c", script, check=False).stdout.strip()


def test_redis_unreachable_from_the_proxy(stack):
    """The proxy is not on the data network: `redis` does not resolve there, and its address does not
    answer either (with --iptables=false isolation is only by network membership; see docs/deploy.md)."""
    assert _in_proxy(stack, "echo ok") == "ok"
    # the proxy itself resolves the replicas (same network): the check below is not vacuous
    assert _in_proxy(stack, "getent hosts chatserve-1 >/dev/null && echo RESOLVED || echo UNRESOLVED") == "RESOLVED"
    assert _in_proxy(stack, "getent hosts redis >/dev/null && echo RESOLVED || echo UNRESOLVED") == "UNRESOLVED"
    rid = stack.compose("ps", "-q", "redis").stdout.strip()
    ips = subprocess.run(["docker", "inspect", "-f",
                          "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", rid],
                         capture_output=True, text=True, check=True).stdout.split()
    assert ips
    for ip in ips:
        out = _in_proxy(stack, f"timeout 3 bash -c '</dev/tcp/{ip}/6379' 2>/dev/null && echo OPEN || echo CLOSED")
        assert out == "CLOSED", f"redis at {ip} answers the proxy"


def test_down_removes_everything(stack):
    stack.compose("down", "-v")
    vols = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert vols == []
