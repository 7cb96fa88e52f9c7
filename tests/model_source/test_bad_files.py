"""Bad model files refused by the real `chatserve serve` before it loads anything: a truncated, corrupt or
non-GGUF file, an unknown tensor type, an unsupported architecture, a missing or damaged safetensors
shard, a model that cannot fit in memory. Each is one line on stderr naming the problem, a non-zero exit
and no traceback; the files are built by gguf-py's writer and safetensors."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from model_files import one_line_error, run_chatserve, tensor_type_offset, write_gguf, write_sharded_safetensors

LOADING = "[chatserve] loading"      # serve prints this just before it maps the weights


def serve_fails(path: Path | str, env: dict[str, str], *flags: str) -> str:
    r = run_chatserve("serve", str(path), "--port", "9", *flags, env=env)
    assert LOADING not in r.stdout, r.stdout + r.stderr
    return one_line_error(r)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "good.gguf")


def test_a_truncated_gguf_names_the_tensor_and_the_missing_bytes(good, tmp_path, cli_env):
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    line = serve_fails(cut, cli_env)
    assert f"{cut}: truncated: the file has {len(data) - 1000:,} bytes" in line
    assert "missing, from tensor token_embd.weight on" in line


def test_a_gguf_cut_inside_its_metadata_is_corrupt(good, tmp_path, cli_env):
    cut = tmp_path / "head.gguf"
    cut.write_bytes(good.read_bytes()[:100])
    assert "is a corrupt GGUF file" in serve_fails(cut, cli_env)


def test_garbage_in_the_metadata_is_corrupt(good, tmp_path, cli_env):
    data = bytearray(good.read_bytes())
    data[16:24] = struct.pack("<Q", 1 << 60)        # the metadata key/value count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert "is a corrupt GGUF file: its metadata does not parse" in serve_fails(bad, cli_env)


def test_a_file_that_is_not_gguf_says_so(tmp_path, cli_env):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + os.urandom(4096))
    assert f"{fake} is not a GGUF file (it starts with b'PK\\x03\\x04'" in serve_fails(fake, cli_env)


def test_an_unknown_tensor_type_is_named(good, tmp_path, cli_env):
    data = bytearray(good.read_bytes())
    at = tensor_type_offset(good, "token_embd.weight")
    data[at:at + 4] = struct.pack("<I", 200)
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(data))
    assert "tensor token_embd.weight has type 200" in serve_fails(odd, cli_env)


def test_an_unsupported_architecture_is_named(tmp_path, cli_env):
    line = serve_fails(write_gguf(tmp_path / "m.gguf", arch="mamba"), cli_env)
    assert "GGUF architecture 'mamba' is not supported" in line


def test_a_missing_safetensors_shard_is_named_never_a_partial_load(tmp_path, cli_env):
    d = write_sharded_safetensors(tmp_path / "m", shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    line = serve_fails(d, cli_env)
    assert "lacks the safetensors shard model-00002-of-00003.safetensors of 3" in line
    (d / "model.safetensors.index.json").unlink()                    # the part names alone say it too
    assert "model-00002-of-00003.safetensors" in serve_fails(d, cli_env)


def test_a_truncated_safetensors_shard_is_named(tmp_path, cli_env):
    d = write_sharded_safetensors(tmp_path / "m", shards=2)
    shard = d / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    assert f"{shard} is not a readable safetensors file" in serve_fails(d, cli_env)


def test_a_model_that_cannot_fit_says_how_much_it_needs_before_loading(good, cli_env):
    line = serve_fails(good, cli_env, "--device", "cpu", "--kv-cache-memory", "64TiB")
    assert "good.gguf needs about 64.0 TiB of memory" in line and "KV cache 64.0 TiB" in line
    assert "is available: lower --kv-cache-memory" in line
