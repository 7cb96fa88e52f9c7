"""Models by Ollama name, read in place from a store the test lays out as Ollama does ($OLLAMA_MODELS:
manifests/<host>/<namespace>/<model>/<tag> → the model layer's blobs/sha256-<hex>); no hub request."""
from __future__ import annotations

from pathlib import Path

from model_files import ollama_model, one_line_error, run_chatserve, write_gguf


def test_names_resolve_to_the_model_blob_without_a_request(hub, cli_env, tmp_path):
    store, data = Path(cli_env["OLLAMA_MODELS"]), write_gguf(tmp_path / "t.gguf").read_bytes()
    blobs = {name: ollama_model(store, name, data + name.encode())
             for name in ("tiny:1b", "tiny:latest", "me/mine:v2", "hf.co/org/Tiny-GGUF:Q4_K_M")}
    for asked, name in (("tiny:1b", "tiny:1b"), ("tiny", "tiny:latest"), ("library/tiny:1b", "tiny:1b"),
                        ("me/mine:v2", "me/mine:v2"), ("hf.co/org/Tiny-GGUF:Q4_K_M", "hf.co/org/Tiny-GGUF:Q4_K_M")):
        r = run_chatserve("models", "pull", asked, env=cli_env)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()) == blobs[name] and blobs[name].read_bytes().startswith(b"GGUF")
    assert hub.requests == []


def test_listing_shows_every_store_model_with_its_size(cli_env, tmp_path):
    store = Path(cli_env["OLLAMA_MODELS"])
    ollama_model(store, "tiny:1b", b"GGUF" + b"\0" * 3000)
    ollama_model(store, "me/mine:v2", b"GGUF" + b"\1" * 100)
    rows = {line.split()[0]: line.split() for line in run_chatserve("models", env=cli_env).stdout.splitlines()}
    assert rows["tiny:1b"][1:4] == ["2.9", "KiB", "ollama"]
    assert rows["me/mine:v2"][1:4] == ["104", "B", "ollama"]


def test_a_blob_shorter_than_its_manifest_says_is_refused(cli_env):
    blob = ollama_model(Path(cli_env["OLLAMA_MODELS"]), "tiny:1b", b"GGUF" + b"\0" * 60, size=4096)
    line = one_line_error(run_chatserve("models", "pull", "tiny:1b", env=cli_env))
    assert str(blob) in line and "64 bytes but its manifest says 4,096" in line
    blob.unlink()
    line = one_line_error(run_chatserve("models", "pull", "tiny:1b", env=cli_env))
    assert "lacks its weights" in line and "ollama pull tiny:1b" in line
