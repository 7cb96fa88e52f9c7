"""Server fixtures: a fake-engine server in a thread (fast), and the real default model served once
per test session by `chatserve serve` in a subprocess (shared by every tests/server file).
Helpers to import live in server_support.py (a `from conftest import` would find another folder's)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_support import real_model_available, start_fake_server, start_real_server  # noqa: E402


@pytest.fixture
def fake_server():
    srv = start_fake_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shared_fake_server():
    srv = start_fake_server()
    yield srv
    srv.stop()



@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """The default model served once for the whole test session (fp32, small KV cache)."""
    if not real_model_available():
        pytest.skip("default model or engine components not available")
    srv = start_real_server(str(tmp_path_factory.mktemp("live")), "--kv-blocks", "512",
                            "--max-model-len", "2048")
    yield srv
    srv.stop()
