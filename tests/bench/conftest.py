"""Fixtures for the benchmark-tool tests: one fake OpenAI server per module, reset before each test."""
from __future__ import annotations

import pytest

from fake_openai import FakeServer


@pytest.fixture(scope="module")
def _fake_module():
    srv = FakeServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def fake(_fake_module):
    _fake_module.reset()
    return _fake_module
