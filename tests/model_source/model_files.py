"""Model files the tests build: a tiny Llama GGUF written by gguf-py's writer (a Q8_0 matrix beside F32
norms), ways to damage one, a sharded safetensors folder, the Hugging Face cache's and Ollama's store's
on-disk layouts, and `chatserve` run as a subprocess."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, LAYERS, HEADS, VOCAB = 64, 1, 4, 256


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A GGUF with llama metadata and a few tensors; enough for header checks, not a usable model."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    q = gguf.quants.quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_type_offset(path: Path, name: str) -> int:
    """The byte offset of tensor `name`'s type field in the file's tensor infos."""
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    return int(t.field.parts[4].ctypes.data - reader.data.ctypes.data)


def write_sharded_safetensors(d: Path, shards: int = 2) -> Path:
    """config.json (llama) + model.safetensors.index.json + `shards` parts, split by layer."""
    from safetensors.numpy import save_file
    from chatserve.runtime.tiny import random_weights, tiny_config
    d.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config("llama", vocab_size=VOCAB, num_hidden_layers=shards)
    (d / "config.json").write_text(json.dumps(cfg))
    weights = {k: v.numpy() for k, v in random_weights(cfg).items()}
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    weight_map = {}
    for k in weights:
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else 0
        weight_map[k] = names[layer % shards]
    for n in names:
        save_file({k: weights[k] for k, f in weight_map.items() if f == n}, str(d / n))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def hf_cache_repo(hf_home: Path, repo_id: str, files: dict[str, bytes], commit: str = "a" * 40) -> Path:
    """huggingface_hub's cache layout: blobs/<sha256>, refs/main, snapshots/<commit>/<file> → ../../blobs."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def ollama_model(store: Path, name: str, weights: Path | bytes, size: int | None = None) -> Path:
    """Ollama's store layout for `name` (model:tag, ns/model:tag or host/ns/model:tag): a manifest naming
    a model layer (and a template layer), the layers as blobs/sha256-<hex>. Returns the model blob."""
    data = weights.read_bytes() if isinstance(weights, Path) else weights
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    layers = []
    for media, content in (("application/vnd.ollama.image.model", data),
                           ("application/vnd.ollama.image.template", b"{{ .Prompt }}")):
        digest = hashlib.sha256(content).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(content)
        layers.append({"mediaType": media, "digest": f"sha256:{digest}",
                       "size": len(content) if size is None or content is not data else size})
    model, tag = name.rsplit(":", 1)
    parts = model.split("/")
    parts = ["registry.ollama.ai", "library"][: 3 - len(parts)] + parts
    manifest = store.joinpath("manifests", *parts, tag)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    config = {"mediaType": "application/vnd.docker.container.image.v1+json",
              "digest": "sha256:" + "0" * 64, "size": 2}
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": config, "layers": layers,
                                    "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}))
    return blobs / f"sha256-{hashlib.sha256(data).hexdigest()}"


def run_chatserve(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chatserve.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The one stderr line of a failed `chatserve` run (no traceback, non-zero exit)."""
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]
