"""Fixtures for the hardening tests: the tiny random model served by `chatserve serve` in a subprocess,
and the server test helpers reused from tests/server (loaded by path; redis_server is in tests/conftest.py)."""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent


def _load(name: str, path: Path):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                  # dataclasses look their module up by name
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


server_helpers = _load("server_conftest", TESTS / "server" / "conftest.py")
start_real_server = server_helpers.start_real_server
start_fake_server = server_helpers.start_fake_server
metric = server_helpers.metric
free_port = server_helpers.free_port


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    try:
        from chatserve.runtime.tiny import make_tiny_model
        return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"tiny model unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    """One tiny-model server shared by the tests that only need a roomy, default-configured engine."""
    srv = start_real_server(str(tmp_path_factory.mktemp("tiny-srv")), "--model", tiny_model,
                            "--kv-blocks", "512", "--max-model-len", "1024", "--max-num-seqs", "64",
                            "--max-waiting-requests", "512", startup_timeout=120)
    yield srv
    srv.stop()


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


os.environ.setdefault("PYTHONUNBUFFERED", "1")
