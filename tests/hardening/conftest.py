"""Fixtures for the hardening tests: the tiny random model served by `chatserve serve` in a subprocess.
Helpers to import live in hardening_support.py; redis_server is in tests/conftest.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardening_support import start_real_server  # noqa: E402

os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    """One tiny-model server shared by the tests that only need a roomy, default-configured engine
    (float32, so greedy outputs do not depend on batch composition)."""
    srv = start_real_server(str(tmp_path_factory.mktemp("tiny-srv")), "--model", tiny_model,
                            "--kv-blocks", "512", "--max-model-len", "1024", "--max-num-seqs", "64",
                            "--max-waiting-requests", "512", "--dtype", "float32")
    yield srv
    srv.stop()
