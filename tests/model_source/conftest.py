"""Fixtures for finding models: a hub-shaped origin on localhost (hub_server.py) and an environment for
`chatserve` subprocesses whose Hugging Face cache, Ollama store and chatserve cache are the test's own,
with HF_ENDPOINT at that origin (no real network). The compiled C kernels are the one thing shared with the
user's cache: their files are keyed by source, flags and CPU and written atomically, and compiling them anew
in every server a test starts cost about a minute of a loaded 2-core box each time."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from chatserve_kernels import cpu_build
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
    cache = tmp_path / "chatserve-cache"
    cpu_build.cache_dir().mkdir(parents=True, exist_ok=True)
    cache.mkdir()
    (cache / "kernels").symlink_to(cpu_build.cache_dir(), target_is_directory=True)
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url, OLLAMA_MODELS=str(tmp_path / "ollama"),
               CHATSERVE_CACHE_DIR=str(cache), HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env
