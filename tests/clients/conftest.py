"""Fixtures for the client-conformance tests: the fake-engine server of tests/server (paced like a model),
with a short SSE keep-alive interval so pings fall between tokens."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))
from server_support import start_fake_server  # noqa: E402

from chatserve.server import sse  # noqa: E402

API_KEY = "sk-clients-test"


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="module")
def api_server():
    """Tokens every 20 ms; the API key is required (clients send it as a bearer token)."""
    srv = start_fake_server(delay=0.02, api_keys=(API_KEY,))
    yield srv
    srv.stop()


@pytest.fixture
def slow_server(monkeypatch):
    """Tokens every 250 ms and a keep-alive comment every 100 ms: pings arrive mid-reply."""
    monkeypatch.setattr(sse, "SSE_PING_SECONDS", 0.1)
    srv = start_fake_server(delay=0.25)
    yield srv
    srv.stop()
