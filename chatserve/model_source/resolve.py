"""A model argument → a local path: an existing file or folder as it is, else a name in Ollama's store
(`qwen3:4b`), else a Hugging Face repo (`org/repo`, `org/repo:Q4_K_M`: cache first, then the Hub).

Not the checks on what is found (check.py); `prepare_model` runs both once, before loading.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from chatserve.config import EngineConfig
from chatserve.model_source import hub, ollama
from chatserve.model_source.errors import ModelSourceError

PATH_SUFFIXES = (".gguf", ".safetensors")


@dataclass(frozen=True)
class ResolvedModel:
    path: str              # a GGUF file or a model folder on this machine
    name: str | None       # the name it was asked for (the API serves it under that name); None: a path
    origin: str            # "path" | "ollama" | "huggingface"


def resolve_model(text: str) -> ResolvedModel:
    """Where the model `text` names is on disk, fetching it from the Hub if it is named and not local."""
    if Path(text).expanduser().exists():
        return ResolvedModel(str(Path(text).expanduser()), None, "path")
    if text.startswith(("/", "./", "../", "~")) or text.lower().endswith(PATH_SUFFIXES):
        raise FileNotFoundError(f"no model file or directory at {text}")
    found = ollama.find_model(text)
    if found is not None:
        return ResolvedModel(str(found.blob), found.name, "ollama")
    repo = hub.parse_repo_name(text)
    if repo is None:
        raise ModelSourceError(f"no model {text!r}: no such file, no such model in Ollama's store "
                               f"({ollama.store_root()}), and not a Hugging Face name (org/repo[:QUANT])")
    return ResolvedModel(str(hub.resolve_repo(repo)), str(repo), "huggingface")


def prepare_model(cfg: EngineConfig, *, count_kv_cache: bool = True) -> EngineConfig:
    """`cfg` with its model resolved to a local path (served under the name it was asked by) and that
    path's files checked, memory included (the KV cache budget too unless count_kv_cache is False: a
    command that sizes its cache later): the one call the commands make before loading."""
    from chatserve.model_source.check import check_model
    model = cfg.model
    if model.model is not None:
        found = resolve_model(model.model)
        model = replace(model, model=found.path,
                        served_model_name=model.served_model_name or found.name)
    cache = cfg.cache if count_kv_cache else replace(cfg.cache, num_blocks=0)
    check_model(model.resolved_model(), cache, model.dtype, on_cpu=lambda: runs_on_cpu(model.device),
                name=model.served_model_name)
    return replace(cfg, model=model)


def runs_on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    from chatserve.runtime.device import resolve_device   # torch: the commands load it next anyway
    return resolve_device(device).type == "cpu"
