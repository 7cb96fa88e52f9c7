"""Helpers for the server and hardening tests: free ports, a fake-engine server in a thread, `chatserve
serve` in a subprocess, and reading /metrics. The fixtures live in conftest.py beside this file."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import httpx
import uvicorn

sys.path.insert(0, os.path.dirname(__file__))
from fakes import FakeTokenizer, VOCAB, fake_engine  # noqa: E402
from session_fakes import free_port  # noqa: E402,F401  (tests/sessions is on sys.path: tests/conftest.py)

from chatserve.config import EngineConfig, ServerConfig, default_model_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class ThreadServer:
    url: str
    state: Any
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_fake_server(*, delay: float = 0.002, max_waiting: int = 64, max_running: int = 8,
                      sampling_defaults: dict | None = None, **server_cfg) -> ThreadServer:
    from chatserve.server.app import build_app
    from chatserve.server.state import single_model_state
    cfg = EngineConfig(server=replace(ServerConfig(), **server_cfg))
    eng = fake_engine(cfg, delay=delay, max_waiting=max_waiting, max_running=max_running)
    state = single_model_state(cfg, eng, FakeTokenizer(), "fake-model", vocab_size=VOCAB,
                               sampling_defaults=sampling_defaults or {})
    app = build_app(state)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           ws_max_size=cfg.server.max_body_bytes + 1024))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    return ThreadServer(f"http://127.0.0.1:{port}", state, server, th)


# ---- the real model -----------------------------------------------------------------------------
@dataclass
class ProcServer:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


# The session's shared default-model server (tests/conftest.py live_server): the default settings but for a
# smaller KV cache (512 blocks, not a memory-sized one) and context; a test that needs a second server of the
# same model (batch invariance's chunked prefill) starts it with these and its one extra flag.
LIVE_SERVER_ARGS = ("--kv-blocks", "512", "--max-model-len", "2048")


def real_model_available() -> bool:
    """The default model is installed (the server's own modules are imported unguarded: an ImportError
    there is a failure, not a skip)."""
    return default_model_path() is not None


def start_real_server(tmp_dir: str, *args: str, startup_timeout: float = 600) -> ProcServer:
    """A real `chatserve serve` on a free port. startup_timeout only bounds a hang: a crash is seen at once
    (poll), and a loaded 2-core box can take minutes to load, repack and warm up."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"serve-{port}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logf = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "chatserve.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--stats-interval", "0", *args],
                            cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
    srv = ProcServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.time() + startup_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chatserve serve exited {proc.returncode}:\n{srv.log()[-4000:]}")
        try:
            if httpx.get(srv.url + "/ready", timeout=1).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    srv.stop(signal.SIGKILL)
    raise RuntimeError(f"chatserve serve not ready in {startup_timeout}s:\n{srv.log()[-4000:]}")


def away_from_a_minute_boundary(margin: float = 15.0) -> None:
    """Sleep past the next clock minute when it is near: the rate limiter's sliding window counter weighs
    the previous minute's count (its windows are aligned to the epoch), so a burst that straddles a
    boundary is counted approximately and may pass one request more than the limit."""
    left = 60.0 - time.time() % 60.0
    if left < margin:
        time.sleep(left + 0.5)


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (labels ignored)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


def poll_metrics(url: str, done: Callable[[str], bool], timeout: float = 5.0, interval: float = 0.05) -> str:
    """GET /metrics until done(text) or `timeout` seconds; returns the last text (the caller asserts)."""
    deadline = time.time() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        if done(text) or time.time() >= deadline:
            return text
        time.sleep(interval)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """POST `body` as JSON over a bare socket, left open: the test reads what it wants, then hangs up."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s
