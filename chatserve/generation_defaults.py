"""Sampling defaults a model ships (--generation-config), as SamplingParams field names: what a request
that leaves a field unset gets instead of OpenAI's default. Read from a `generation_config.json` (beside
safetensors, or in the folder the flag names) or from a GGUF file's `general.sampling.*` keys.

Only reads the files; the HTTP layer applies the values. Not the web UI's defaults (static/js/store.js).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from chatserve.config import ModelConfig

# generation_config.json key → SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key (llama.cpp's gguf.Keys.General.SAMPLING_*) → SamplingParams field
_GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                "general.sampling.penalty_repeat": "repetition_penalty"}
_INTS = ("top_k", "max_tokens")
# --generation-config values that mean "OpenAI's defaults" (vllm: vLLM's name for its own defaults)
_NONE = ("none", "vllm")


def generation_config_file(model: ModelConfig) -> Path | None:
    """The generation_config.json --generation-config points at, or None ("none"/"vllm", or none shipped)."""
    choice = model.generation_config
    if choice.lower() in _NONE:
        return None
    if choice.lower() == "auto":
        path = Path(model.resolved_model())
        candidate = path / "generation_config.json" if path.is_dir() else None
    else:
        path = Path(choice).expanduser()
        candidate = path / "generation_config.json" if path.is_dir() else path
        if not candidate.is_file():
            raise FileNotFoundError(f"--generation-config {choice}: no generation_config.json there")
    return candidate if candidate is not None and candidate.is_file() else None


def _number(name: str, value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if name in _INTS else float(value)


def load_generation_defaults(model: ModelConfig, gguf_reader: Callable[[Path], Any] | None = None) -> dict[str, Any]:
    """{SamplingParams field: value} from the model's generation config; {} when there is none.
    gguf_reader: how a GGUF file's metadata is read (default gguf.GGUFReader; the server passes the
    weights loader's faster one, which this layer may not import)."""
    path = generation_config_file(model)
    if path is None:
        gguf = _auto_gguf(model)
        return gguf_sampling_defaults(gguf, gguf_reader) if gguf is not None else {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable generation config ({e})") from None
    out: dict[str, Any] = {}
    for key, name in _FIELDS.items():
        value = _number(name, data.get(key) if isinstance(data, dict) else None)
        if value is not None:
            out[name] = value
    return out


def _auto_gguf(model: ModelConfig) -> Path | None:
    """The GGUF file whose sampling keys --generation-config auto reads, else None."""
    if model.generation_config.lower() != "auto":
        return None
    path = Path(model.resolved_model())
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def gguf_sampling_defaults(path: str | Path, gguf_reader: Callable[[Path], Any] | None = None) -> dict[str, Any]:
    """{SamplingParams field: value} from a GGUF file's `general.sampling.*` keys ({} when it has none).
    A key llama.cpp writes but chatserve has no field for (xtc, mirostat, sequence) is left out."""
    from gguf import GGUFReader
    read: Callable[[Path], Any] = gguf_reader if gguf_reader is not None else GGUFReader
    try:
        reader = read(Path(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    out: dict[str, Any] = {}
    for key, name in _GGUF_FIELDS.items():
        field = reader.fields.get(key)
        value = _number(name, field.contents()) if field is not None else None
        if value is not None:
            out[name] = value
    return out
