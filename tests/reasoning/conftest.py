"""Servers of the scripted tiny reasoning checkpoints (think_models.py), one per family per test module."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))
from server_support import start_real_server  # noqa: E402

import think_models  # noqa: E402


def _serve(tmp_path_factory, family: str, chains):
    d = think_models.build(tmp_path_factory.mktemp(family) / "ckpt", family, chains)
    srv = start_real_server(str(tmp_path_factory.mktemp(family + "-log")), "--model", str(d),
                            "--max-model-len", "1024", "--kv-blocks", "128", "--served-model-name", family)
    return srv


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    srv = _serve(tmp_path_factory, "qwen3", think_models.qwen3_chains())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory):
    srv = _serve(tmp_path_factory, "deepseek_r1", think_models.deepseek_chains())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory):
    srv = _serve(tmp_path_factory, "gpt_oss", think_models.gpt_oss_chains())
    yield srv
    srv.stop()
