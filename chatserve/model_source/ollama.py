"""Ollama's model store ($OLLAMA_MODELS, else ~/.ollama/models), read in place: a name such as `qwen3:4b`
→ manifests/registry.ollama.ai/library/qwen3/4b → its model layer → blobs/sha256-<hex>, a GGUF file.

Read-only: chatserve never pulls into or edits the store. Not Hugging Face names (hub.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from chatserve.model_source.errors import ModelSourceError

DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class OllamaModel:
    name: str        # as `ollama list` shows it: qwen3:4b, me/mine:latest, hf.co/org/repo:Q4_K_M
    blob: Path       # the GGUF file
    size: int        # bytes, as the manifest states them


def store_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def manifest_path(text: str, root: Path | None = None) -> Path | None:
    """Where the manifest of `text` would be ([host/][namespace/]model[:tag]); None if it is no such name."""
    name, tag = text.strip(), DEFAULT_TAG
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    parts = name.split("/")
    if not all(parts) or len(parts) > 3 or not tag or any(p in (".", "..") for p in (*parts, tag)):
        return None
    host, namespace, model = [DEFAULT_HOST, DEFAULT_NAMESPACE][: 3 - len(parts)] + parts
    return (root or store_root()) / "manifests" / host / namespace / model / tag


def read_manifest(path: Path, name: str) -> OllamaModel:
    """The model layer's blob of one manifest, checked to exist with the size the manifest states."""
    root = path.parents[4]
    try:
        layers = json.loads(path.read_text())["layers"]
        layer = next(x for x in layers if x.get("mediaType") == MODEL_LAYER)
        digest, size = str(layer["digest"]), int(layer["size"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise ModelSourceError(f"Ollama's manifest {path} names no model layer") from None
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise ModelSourceError(f"Ollama's model {name} lacks its weights {blob} (run `ollama pull {name}`)")
    if blob.stat().st_size != size:
        raise ModelSourceError(f"Ollama's blob {blob} is {blob.stat().st_size:,} bytes but its manifest "
                               f"says {size:,} (an interrupted pull? run `ollama pull {name}`)")
    return OllamaModel(name, blob, size)


def find_model(text: str) -> OllamaModel | None:
    """The model `text` names in the store, or None when the store has no manifest by that name."""
    path = manifest_path(text)
    if path is None or not path.is_file():
        return None
    return read_manifest(path, display_name(path))


def display_name(manifest: Path) -> str:
    host, namespace, model, tag = manifest.parts[-4:]
    if host == DEFAULT_HOST:
        return f"{model}:{tag}" if namespace == DEFAULT_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def local_models(root: Path | None = None) -> list[OllamaModel]:
    """Every model in the store whose weights are present (a broken entry is left out)."""
    manifests = (root or store_root()) / "manifests"
    found = []
    for path in sorted(manifests.glob("*/*/*/*")):
        if path.is_file():
            try:
                found.append(read_manifest(path, display_name(path)))
            except ModelSourceError:
                continue
    return found
