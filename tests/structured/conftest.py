"""tests/structured use the session's real default-model server (tests/conftest.py live_server)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def structured_server(live_server):
    return live_server


@pytest.fixture(scope="session")
def client(live_server):
    import openai
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
