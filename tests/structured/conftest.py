"""The real default model served once for tests/structured (its own server: these tests send grammars)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
from server_support import real_model_available, start_real_server  # noqa: E402


@pytest.fixture(scope="session")
def structured_server(tmp_path_factory):
    if not real_model_available():
        pytest.skip("default model or engine components not available")
    srv = start_real_server(str(tmp_path_factory.mktemp("structured")), "--kv-blocks", "1024",
                            "--max-model-len", "2048")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(structured_server):
    import openai
    return openai.OpenAI(base_url=structured_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
