"""Models by Hugging Face name: `chatserve models pull` through the real huggingface_hub client against a
hub-shaped origin on localhost (HF_ENDPOINT), the cache it fills (and one the test lays out by hand), HF_TOKEN
and HF_HUB_OFFLINE; `chatserve models` lists what is local with sizes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hub_server import Hub, HubRepo
from model_files import hf_cache_repo, one_line_error, run_chatserve, write_gguf

GGUF_REPO = "org/Tiny-GGUF"


@pytest.fixture
def gguf_bytes(tmp_path: Path) -> bytes:
    return write_gguf(tmp_path / "tiny.gguf").read_bytes()


@pytest.fixture
def gguf_repo(hub: Hub, gguf_bytes: bytes) -> HubRepo:
    repo = HubRepo({"tiny-Q8_0.gguf": gguf_bytes, "tiny-Q4_K_M.gguf": gguf_bytes[:-7] + b"q4km!!!",
                    "tiny-F16.gguf": b"GGUF-f16", "mmproj-tiny-F16.gguf": b"GGUF-mm", "README.md": b"# tiny"})
    hub.repos[GGUF_REPO] = repo
    return repo


def pull(name: str, env: dict[str, str], **extra: str):
    return run_chatserve("models", "pull", name, env={**env, **extra})


def test_a_quant_tag_downloads_that_gguf_file_into_the_hub_cache(hub, gguf_repo, gguf_bytes, cli_env, tmp_path):
    r = pull(f"{GGUF_REPO}:q8_0", cli_env)           # the tag matches case-insensitively, as llama.cpp's
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.read_bytes() == gguf_bytes
    snapshots = tmp_path / "hf" / "hub" / "models--org--Tiny-GGUF" / "snapshots"
    assert path == snapshots / gguf_repo.commit / "tiny-Q8_0.gguf" and path.is_symlink()
    fetched = [q.path for q in hub.requests if q.method == "GET" and "/resolve/" in q.path]
    assert fetched == [f"/{GGUF_REPO}/resolve/main/tiny-Q8_0.gguf"]     # no other quant, no README


def test_no_tag_takes_q4_k_m_and_an_unknown_tag_lists_the_quants(gguf_repo, cli_env):
    r = pull(GGUF_REPO, cli_env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).name == "tiny-Q4_K_M.gguf"
    line = one_line_error(pull(f"{GGUF_REPO}:Q5_K_M", cli_env))
    assert "no Q5_K_M file" in line and "F16, Q4_K_M, Q8_0" in line      # mmproj is not a model


def test_a_safetensors_repo_fetches_weights_config_and_tokenizer_only(hub, cli_env):
    files = {"config.json": b'{"model_type": "llama"}', "model-00001-of-00002.safetensors": b"s1",
             "model-00002-of-00002.safetensors": b"s2", "tokenizer.json": b"{}",
             "generation_config.json": b"{}", "pytorch_model.bin": b"bin", "onnx/model.onnx": b"onnx"}
    hub.repos["org/Tiny"] = HubRepo(files)
    r = pull("org/Tiny", cli_env)
    assert r.returncode == 0, r.stderr
    snap = Path(r.stdout.strip())
    got = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
    assert got == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors", "tokenizer.json"]
    assert (snap / "model-00002-of-00002.safetensors").read_bytes() == b"s2"


def test_hf_token_is_sent_to_the_hub(hub, gguf_repo, cli_env):
    assert pull(f"{GGUF_REPO}:Q8_0", cli_env, HF_TOKEN="hf_test_token").returncode == 0
    hub_calls = [q for q in hub.requests if "Tiny-GGUF" in q.path]
    assert hub_calls and all(q.headers.get("authorization") == "Bearer hf_test_token" for q in hub_calls)


def test_a_cached_model_is_used_without_a_request_online_or_offline(hub, gguf_repo, cli_env):
    first = pull(f"{GGUF_REPO}:Q8_0", cli_env)
    assert first.returncode == 0, first.stderr
    hub.requests.clear()
    for extra in ({}, {"HF_HUB_OFFLINE": "1"}):
        r = pull(f"{GGUF_REPO}:Q8_0", cli_env, **extra)
        assert r.returncode == 0 and r.stdout == first.stdout, r.stderr
    assert [q.path for q in hub.requests if "Tiny" in q.path] == []


def test_offline_without_the_model_in_the_cache_says_so_and_asks_nothing(hub, gguf_repo, cli_env):
    line = one_line_error(pull(f"{GGUF_REPO}:Q8_0", cli_env, HF_HUB_OFFLINE="1"))
    assert "not in the Hugging Face cache" in line and "HF_HUB_OFFLINE" in line
    assert [q.path for q in hub.requests if "Tiny" in q.path] == []


def test_a_cache_laid_out_by_hand_is_found_without_the_hub(hub, cli_env, tmp_path, gguf_bytes):
    cfg = json.dumps({"model_type": "llama"}).encode()
    snap = hf_cache_repo(tmp_path / "hf", "org/Cached", {"config.json": cfg, "model.safetensors": b"w" * 100,
                                                           "tokenizer.json": b"{}"})
    gguf_snap = hf_cache_repo(tmp_path / "hf", "org/Cached-GGUF", {"cached-Q6_K.gguf": gguf_bytes})
    assert Path(pull("org/Cached", cli_env).stdout.strip()) == snap
    assert Path(pull("org/Cached-GGUF:Q6_K", cli_env).stdout.strip()) == gguf_snap / "cached-Q6_K.gguf"
    assert hub.requests == []
    listing = run_chatserve("models", env=cli_env).stdout
    rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
    assert "100 B" in rows["org/Cached"] and "huggingface" in rows["org/Cached"]
    assert f"{len(gguf_bytes) / 1024:.1f} KiB" in rows["org/Cached-GGUF:Q6_K"]


def test_an_unknown_repo_is_one_line_naming_it(hub, cli_env):
    line = one_line_error(pull("org/Nope", cli_env))
    assert "could not fetch org/Nope" in line and hub.url in line


def test_a_name_that_is_nothing_is_one_line(cli_env):
    line = one_line_error(pull("nothing-here", cli_env))
    assert "no model 'nothing-here'" in line and "Ollama" in line
    assert "no model file or directory at ./missing.gguf" in one_line_error(pull("./missing.gguf", cli_env))
