"""Server fixtures: a fake-engine server in a thread (fast), and the real default model served once
per test session by `chatserve serve` in a subprocess (tests/conftest.py's live_server, shared by every
tests/server and tests/structured file).
Helpers to import live in server_support.py (a `from conftest import` would find another folder's)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_support import start_fake_server  # noqa: E402


@pytest.fixture
def fake_server():
    srv = start_fake_server()
    yield srv
    srv.stop()
