"""Runs docker/haproxy.cfg — the very file compose mounts — on loopback ports, for the topology tests.

Only the environment differs from compose: the bind address and the two replica addresses.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from session_fakes import free_port  # noqa: F401  (tests/sessions is on sys.path: tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "docker" / "haproxy.cfg"


def haproxy_exe() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.path.exists(p)), None)


def proxy_env(port: int, stats_port: int, replicas: list[str]) -> dict[str, str]:
    env = {**os.environ, "CHATSERVE_PROXY_BIND": f"127.0.0.1:{port}",
           "CHATSERVE_STATS_BIND": f"127.0.0.1:{stats_port}"}
    for i, addr in enumerate(replicas, 1):
        env[f"CHATSERVE_REPLICA_{i}"] = addr
    return env


class Proxy:
    def __init__(self, replicas: list[str], log_path: Path, cfg: Path = CFG) -> None:
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([haproxy_exe() or "haproxy", "-db", "-f", str(cfg)],
                                     env=proxy_env(self.port, self.stats_port, replicas),
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def server_states(self) -> dict[str, str]:
        """replica name -> state (UP, DOWN, ...) from HAProxy's Prometheus exporter."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/metrics", timeout=2) as r:
            text = r.read().decode()
        out = {}
        for m in re.finditer(r'haproxy_server_status\{proxy="replicas",server="(\w+)",state="(\w+)"\} 1', text):
            out[m.group(1)] = m.group(2)
        return out

    def wait_states(self, want: dict[str, str], timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        last: dict[str, str] = {}
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}")
            try:
                last = self.server_states()
            except OSError:
                last = {}
            if all(last.get(k) == v for k, v in want.items()):
                return
            time.sleep(0.1)
        raise TimeoutError(f"servers {last}, wanted {want}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
