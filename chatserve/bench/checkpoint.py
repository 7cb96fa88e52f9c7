"""`chatserve bench build-model`: a random-weight HF checkpoint with a real model's shape (Llama-3.2-1B;
Qwen3-30B-A3B's layers, two of its 48) and the default model's tokenizer, built by transformers, so a
memory-bound decode can be measured (by chatserve and by vLLM) without a download. Its outputs are noise;
its bytes and shapes are real.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B), less its vocabulary: the default model's
# tokenizer (49,152 tokens) replaces Llama 3's, so bos/eos come from that tokenizer.
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
    },
    # Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B) with 2 of its 48 layers: each layer as the real
    # one (128 experts of 768, top 8 renormalized, GQA 32/4 of 128), 1.2 B parameters, ~76 M active a token
    "qwen3-30b-a3b-2l": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 2,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "use_sliding_window": False,
        "tie_word_embeddings": False, "attention_bias": False,
    },
}
VOCAB = 49152                 # the default model's tokenizer (SmolLM2)
BOS, EOS = 1, 2               # its <|im_start|> and <|im_end|>
STAMP = "chatserve-shape.json"


def checkpoint_config(shape: str, **overrides) -> dict:
    """The config.json dict of `shape` with the default tokenizer's vocabulary; overrides: config keys."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    return copy.deepcopy({**SHAPES[shape], "vocab_size": VOCAB, "bos_token_id": BOS, "eos_token_id": EOS,
                          "torch_dtype": "bfloat16", **overrides})


def default_dir(shape: str) -> Path:
    from chatserve.disk_cache import cache_dir

    return cache_dir("checkpoints") / shape


def is_built(out: Path, cfg: dict, seed: int) -> bool:
    try:
        return json.loads((out / STAMP).read_text()) == {"config": cfg, "seed": seed}
    except (OSError, ValueError):
        return False


def build_checkpoint(out: str | os.PathLike, shape: str = "llama-3.2-1b", seed: int = 0,
                     progress: bool = True, **overrides) -> Path:
    """Write the checkpoint dir (config.json, generation_config.json, model.safetensors in bf16, the
    tokenizer files) at `out` unless the same build is already there; returns its path. The model is
    created in bf16 (about 2 bytes per parameter in memory) and written in one rename."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from chatserve.runtime.tiny import default_tokenizer_dir

    cfg = checkpoint_config(shape, **overrides)
    out = Path(out)
    if is_built(out, cfg, seed):
        return out
    t0 = time.perf_counter()
    # a copy: transformers 5 writes rope_theta into the rope_scaling dict it is given
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in copy.deepcopy(cfg).items()
                                                         if k not in ("model_type", "torch_dtype")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)   # transformers' init
    n_params = sum(p.numel() for p in model.parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="100GB")
        del model
        _add_legacy_keys(tmp / "config.json", cfg)
        GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, do_sample=False).save_pretrained(tmp)
        for f in default_tokenizer_dir().iterdir():
            if f.is_file():
                shutil.copy(f, tmp / f.name)
        (tmp / STAMP).write_text(json.dumps({"config": cfg, "seed": seed}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"[chatserve] built {shape} ({n_params / 1e9:.2f} B parameters, bf16) at {out} in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def _add_legacy_keys(path: Path, cfg: dict) -> None:
    """transformers 5 writes rope_parameters and dtype; readers pinned to 4.x (older vLLM builds) look
    for rope_theta, rope_scaling and torch_dtype. Both spellings say the same thing."""
    written = json.loads(path.read_text())
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        if key in cfg:
            written.setdefault(key, cfg[key])
    path.write_text(json.dumps(written, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench build-model", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--out", default=None, help="checkpoint dir (default: the chatserve cache's checkpoints/SHAPE)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    print(build_checkpoint(args.out or default_dir(args.shape), args.shape, args.seed))
    return 0
