"""The name rules, without a process: quant tags read from GGUF file names, which file a name picks from a
repo's listing, and where an Ollama name's manifest lives."""
from __future__ import annotations

from pathlib import Path

import pytest

from chatserve.model_source.errors import ModelSourceError
from chatserve.model_source.hub import RepoName, complete_safetensors, parse_repo_name, pick_gguf, quant_tag
from chatserve.model_source.ollama import manifest_path


@pytest.mark.parametrize("filename, tag", [
    ("Qwen3-4B-Q4_K_M.gguf", "Q4_K_M"), ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
    ("smollm2-135m-instruct.q4_1.gguf", "Q4_1"), ("sub/dir/model-f16.gguf", "F16"),
    ("big-Q8_0-00001-of-00003.gguf", "Q8_0")])
def test_quant_tag_is_the_last_part_of_the_name(filename, tag):
    assert quant_tag(filename) == tag


def test_repo_names_parse_with_and_without_a_tag():
    assert parse_repo_name("Qwen/Qwen3-4B-GGUF:Q4_K_M") == RepoName("Qwen/Qwen3-4B-GGUF", "Q4_K_M")
    assert parse_repo_name("hf.co/Qwen/Qwen3-4B") == RepoName("Qwen/Qwen3-4B", None)
    assert parse_repo_name("qwen3:4b") is None and parse_repo_name("a/b/c") is None


def test_pick_prefers_safetensors_without_a_tag_and_refuses_split_ggufs():
    both = ["config.json", "model.safetensors", "m-Q4_K_M.gguf"]
    assert pick_gguf(RepoName("o/r", None), both) is None
    assert pick_gguf(RepoName("o/r", "q4_k_m"), both) == "m-Q4_K_M.gguf"
    assert pick_gguf(RepoName("o/r", None), ["only-Q6_K.gguf", "mmproj-F16.gguf"]) == "only-Q6_K.gguf"
    with pytest.raises(ModelSourceError, match="split GGUF"):
        pick_gguf(RepoName("o/r", "Q8_0"), ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"])
    with pytest.raises(ModelSourceError, match="has no GGUF files"):
        pick_gguf(RepoName("o/r", "Q8_0"), both[:2])


def test_a_snapshot_missing_a_shard_is_not_complete(tmp_path: Path):
    parts = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert complete_safetensors(tmp_path, ["config.json", *parts])
    assert not complete_safetensors(tmp_path, ["config.json", parts[0]])
    assert not complete_safetensors(tmp_path, parts)                    # no config.json


def test_ollama_names_map_to_their_manifest_paths(tmp_path: Path):
    m = tmp_path / "manifests"
    assert manifest_path("qwen3:4b", tmp_path) == m / "registry.ollama.ai/library/qwen3/4b"
    assert manifest_path("qwen3", tmp_path) == m / "registry.ollama.ai/library/qwen3/latest"
    assert manifest_path("hf.co/org/repo:Q4_K_M", tmp_path) == m / "hf.co/org/repo/Q4_K_M"
    assert manifest_path("../etc:x", tmp_path) is None and manifest_path("a/b/c/d", tmp_path) is None
