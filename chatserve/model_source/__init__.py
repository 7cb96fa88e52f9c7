"""Where a model's files come from: a local path, a Hugging Face repo by name (`org/repo[:QUANT]`,
through huggingface_hub and its cache), or Ollama's model store (`qwen3:4b`); and whether those files
can be served (a readable GGUF, every safetensors shard, memory enough) before anything large is mapped.

Not loading (chatserve/runtime/weights.py) and not the command line (chatserve/model_source/command.py
is `chatserve models`; `chatserve serve` calls `resolve_model` and `check_model` once).
"""
from __future__ import annotations

from chatserve.model_source.errors import ModelCheckError, ModelSourceError
from chatserve.model_source.resolve import ResolvedModel, prepare_model, resolve_model

__all__ = ["ModelCheckError", "ModelSourceError", "ResolvedModel", "prepare_model", "resolve_model"]
