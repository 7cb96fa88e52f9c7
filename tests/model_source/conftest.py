"""Fixtures for finding models: a hub-shaped origin on localhost (hub_server.py) and an environment for
`chatserve` subprocesses whose Hugging Face cache, Ollama store and chatserve cache are the test's own,
with HF_ENDPOINT at that origin (no real network)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hub_server import Hub


@pytest.fixture
def hub():
    h = Hub().start()
    yield h
    h.stop()


@pytest.fixture
def cli_env(tmp_path: Path, hub: Hub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "OLLAMA_"))}
    env.pop("TRANSFORMERS_OFFLINE", None)
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url, OLLAMA_MODELS=str(tmp_path / "ollama"),
               CHATSERVE_CACHE_DIR=str(tmp_path / "chatserve-cache"), HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env
