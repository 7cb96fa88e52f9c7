"""Fixtures shared by every test folder: a throwaway redis-server (skipped with a hint when missing) and
a tiny random-weight model directory."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "sessions"))

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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    try:
        from chatserve.runtime.tiny import make_tiny_model
        return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"tiny model unavailable: {e}")


def pytest_collection_modifyitems(config, items):
    for item in items:                       # `-m "not redis"` deselects everything needing redis-server
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
