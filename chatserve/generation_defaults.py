"""Sampling defaults a model ships in its generation_config.json (--generation-config), as
SamplingParams field names: what a request that leaves a field unset gets instead of OpenAI's default.

Only reads the file; the HTTP layer applies the values. A GGUF file ships none.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chatserve.config import ModelConfig

# generation_config.json key → SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_file(model: ModelConfig) -> Path | None:
    """The generation_config.json --generation-config points at, or None ("none", or none shipped)."""
    choice = model.generation_config
    if choice.lower() in ("none", "vllm"):
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


def load_generation_defaults(model: ModelConfig) -> dict[str, Any]:
    """{SamplingParams field: value} from the model's generation config; {} when there is none."""
    path = generation_config_file(model)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable generation config ({e})") from None
    out: dict[str, Any] = {}
    for key, name in _FIELDS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return out
