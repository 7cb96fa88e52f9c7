"""Helpers for the hardening tests: the server test helpers (tests/server/server_support.py) plus KV and
SSE readers. Imported by name; the fixtures live in conftest.py beside this file."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

TESTS = Path(__file__).resolve().parent.parent
for d in ("server", "sessions"):
    if str(TESTS / d) not in sys.path:
        sys.path.insert(0, str(TESTS / d))

import session_fakes  # noqa: E402,F401
from server_support import (away_from_a_minute_boundary, free_port, metric, poll_metrics,  # noqa: E402,F401
                            start_fake_server, start_real_server)


def kv_used(url: str, headers: dict | None = None) -> float:
    return metric(httpx.get(url + "/metrics", headers=headers, timeout=10).text,
                  "chatserve:kv_cache_usage_perc")


def wait_kv_zero(url: str, timeout: float = 20.0) -> float:
    """Poll /metrics until KV usage is 0 (returns it, 0.0 on success; the last value on timeout)."""
    deadline = time.time() + timeout
    v = kv_used(url)
    while v and time.time() < deadline:
        time.sleep(0.1)
        v = kv_used(url)
    return v


def sse_datas(lines) -> list[str]:
    return [ln[6:] for ln in lines if ln.startswith("data: ")]
