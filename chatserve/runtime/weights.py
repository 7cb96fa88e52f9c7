"""Model weights: a GGUF file (read and dequantized with the `gguf` package) or a safetensors
directory (single or sharded, HF names + config.json) → an `ArchConfig` and HF-named torch tensors.

Not a model: fusing and placing the tensors is the model's job (models/llama.py).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# GGUF architectures we run, and whether llama.cpp's converter permuted their Q/K rows.
_GGUF_ARCHS: dict[str, bool] = {"llama": True, "mistral": True, "qwen2": False}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16") from None


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyperparameters of a Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, SmolLM2)."""

    arch: str                       # llama | mistral | qwen2
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None        # HF form: {"rope_type": "llama3"|"linear", "factor": ..., ...}
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs` (llama3 scaling baked in)
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Q/K/V projections have biases (Qwen2)
    sliding_window: int | None = None       # Mistral: a token sees the last N positions (itself included)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LoadedWeights:
    config: ArchConfig
    tensors: dict[str, torch.Tensor]   # HF names: model.layers.0.self_attn.q_proj.weight, ...
    source: str                        # "gguf" | "safetensors"
    four_bit: bool = False             # GGUF whose matrices are mostly 4-bit (Q4_0/Q4_1/Q4_K): int4
                                       # weight-only decode reproduces them at no added error


def load_weights(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
                 progress: bool = True) -> LoadedWeights:
    """Load a GGUF file or a safetensors directory (or a .safetensors file next to config.json)."""
    p = Path(path)
    dt = torch_dtype(dtype)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, dt, progress)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not any(p.glob("*.safetensors")) and len(ggufs) == 1:
            return load_gguf(ggufs[0], dt, progress)
        return load_safetensors_dir(p, dt, progress)
    if p.is_file() and p.suffix == ".safetensors":
        return load_safetensors_dir(p.parent, dt, progress, files=[p])
    raise FileNotFoundError(f"no GGUF file or safetensors directory at {path}")


# ---------------------------------------------------------------------------------------------
# GGUF

def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF rotate-half layout ← GGML interleaved pairs).

    Per head the converter reorders rows [0..d/2) and [d/2..d) into pairs (0, d/2), (1, d/2+1), ...;
    here rows of each head are read as [d/2, 2] and transposed back to [2, d/2].
    """
    # w: [n_heads * head_dim, ...]
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader, tensor_shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
    arch = str(_field(reader, "general.architecture", "llama"))
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCHS)})")

    def a(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    kv_heads = a("attention.head_count_kv", heads)
    head_dim = int(a("attention.key_length", hidden // heads))
    vocab = a("vocab_size")
    if vocab is None:
        vocab = tensor_shapes["token_embd.weight"][0]
    scaling = None
    stype = a("rope.scaling.type")
    if stype in ("linear",) and a("rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif stype not in (None, "none"):
        log.warning("GGUF rope scaling %r is not supported; using plain RoPE", stype)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ArchConfig(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads if not isinstance(kv_heads, list) else kv_heads[0]),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(a("context_length", 4096)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None


def gguf_reader(path: str | os.PathLike):
    """A GGUFReader that parses metadata over a plain ndarray view of its memmap.

    Slicing a np.memmap runs memmap.__array_finalize__ on every one of the ~10^6 small reads the
    reader makes for a 49k-token vocabulary (2.7 s → 1 s here); the bytes are the same mapping.
    """
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        def _get(self, *args, **kwargs):
            if type(self.data) is not np.ndarray:
                self.data = self.data.view(np.ndarray)
            return super()._get(*args, **kwargs)

    return _Reader(str(path))


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              progress: bool = True) -> LoadedWeights:
    """Read a GGUF file, dequantize every tensor (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K/...)."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    # numpy shapes (row-major, i.e. GGUF ne reversed) after dequantization
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    cfg = _gguf_config(reader, shapes)
    permuted = _GGUF_ARCHS[cfg.arch]
    tensors: dict[str, torch.Tensor] = {}
    freq_factors = None
    n4 = sum(1 for t in reader.tensors if t.tensor_type.name in ("Q4_0", "Q4_1", "Q4_K"))
    n_matrices = sum(1 for t in reader.tensors if len(t.shape) == 2)
    bar = tqdm(reader.tensors, desc=f"loading {Path(path).name}", unit="tensor",
               disable=not progress, file=sys.stderr, leave=False)
    for t in bar:
        arr = dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(shapes[t.name])
        if not arr.flags.writeable:          # F32 tensors come back as views of the read-only map
            arr = arr.copy()
        if t.name == "rope_freqs.weight":
            freq_factors = tuple(float(x) for x in arr.reshape(-1))
            continue
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            log.warning("ignoring GGUF tensor %s", t.name)
            continue
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            n = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            arr = unpermute_qk(arr, n)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    bar.close()
    if freq_factors is not None:
        cfg = replace(cfg, rope_freq_factors=freq_factors)
    return LoadedWeights(cfg, tensors, "gguf", four_bit=n4 * 2 > n_matrices)


# ---------------------------------------------------------------------------------------------
# safetensors + config.json

def config_from_hf(hf: dict) -> ArchConfig:
    """ArchConfig from an HF config.json dict (LlamaConfig / MistralConfig / Qwen2Config)."""
    model_type = hf.get("model_type", "llama")
    arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
    if arch is None:
        raise ValueError(f"model_type {model_type!r} is not supported (llama, mistral, qwen2)")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    scaling = hf.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] not in ("default", "linear", "llama3"):
            log.warning("rope scaling %r is not supported; using plain RoPE", scaling["rope_type"])
            scaling = None
        elif scaling["rope_type"] == "default":
            scaling = None
    # transformers >= 5 may keep rope_theta inside rope_parameters
    rope_params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    if scaling is None and rope_params.get("rope_type") in ("linear", "llama3"):
        scaling = dict(rope_params)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bias = bool(hf.get("attention_bias", False)) or arch == "qwen2"
    window = hf.get("sliding_window") if arch == "mistral" else None
    if arch == "qwen2" and hf.get("use_sliding_window"):
        log.warning("Qwen2 per-layer sliding windows are not supported; using full attention")
    return ArchConfig(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bias,
        sliding_window=int(window) if window else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_safetensors_dir(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         progress: bool = True, files: list[Path] | None = None) -> LoadedWeights:
    from safetensors import safe_open

    d = Path(path)
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{d} has no config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    if files is None:
        index = d / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [d / n for n in names]
        else:
            files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(keys, desc=f"loading {d.name}", unit="tensor", disable=not progress,
                     file=sys.stderr, leave=False):
        name = k if k.startswith(("model.", "lm_head.")) else f"model.{k}"
        tensors[name] = h.get_tensor(k).to(dtype)
    if "lm_head.weight" not in tensors and not cfg.tie_word_embeddings:
        cfg = replace(cfg, tie_word_embeddings=True)
    return LoadedWeights(cfg, tensors, "safetensors")


def rope_inv_freq(cfg: ArchConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] in float64→float32, with linear / llama3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    s = cfg.rope_scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type"))
    factor = float(s.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(s.get("low_freq_factor", 1.0))
        high = float(s.get("high_freq_factor", 4.0))
        old_len = float(s.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv
