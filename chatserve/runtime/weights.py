"""Model weights: a GGUF file (read and dequantized with the `gguf` package) or a safetensors
directory (single or sharded, HF names + config.json) → an `ArchConfig` and HF-named torch tensors.

Not a model: fusing and placing the tensors is the model's job (models/llama.py).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# GGUF architectures we run, and whether llama.cpp's converter permuted their Q/K rows.
_GGUF_ARCHS: dict[str, bool] = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False,
                                "gemma2": False, "gemma3": False, "phi3": False}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16") from None


class UnsupportedModelError(ValueError):
    """A checkpoint chatserve cannot run exactly: an unknown architecture or setting, or tensors the
    model would leave unused or miss. Its message is one line meant for the operator."""


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyperparameters of a decoder family (models/: llama, mistral, qwen2, qwen3, gemma2,
    gemma3, phi3). Family-specific switches default to the plain Llama behaviour."""

    arch: str                       # a key of models.FAMILIES
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
    rope_scaling: dict | None = None        # normalized: {"rope_type": linear|dynamic|yarn|llama3|longrope, ...}
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs` (llama3 scaling baked in)
    partial_rotary_factor: float = 1.0      # Phi-4-mini: only the first 3/4 of each head is rotated
    local_rope_theta: float | None = None   # Gemma 3: sliding layers' own base (and no scaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Q/K/V projections have biases (Qwen2; Llama attention_bias)
    o_bias: bool = False                    # o_proj has a bias (Llama attention_bias)
    mlp_bias: bool = False                  # gate/up/down have biases (Llama mlp_bias)
    qk_norm: bool = False                   # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"                # silu | gelu_pytorch_tanh (Gemma's GeGLU)
    query_pre_attn_scalar: float | None = None   # Gemma: scores scaled by this ** -0.5, not head_dim
    attn_logit_softcap: float | None = None      # Gemma 2: scores = c·tanh(scores / c)
    final_logit_softcap: float | None = None     # Gemma 2: logits = c·tanh(logits / c)
    sliding_window: int | None = None       # a token sees the last N positions (itself included)
    layer_types: tuple[str, ...] | None = None   # per layer "sliding_attention" | "full_attention";
                                                 # None: every layer slides when sliding_window is set
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, None for a full-attention layer."""
        if not self.sliding_window:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer keeps (KV older than it is never read again), None if any layer
        attends globally: the KV cache manager frees blocks only past this."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if not windows or None in windows else max(windows)


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


def _gguf_rope(a, arch: str, mpe: int, tensor_shapes: dict) -> dict | None:
    """RoPE scaling from llama.cpp's keys: linear, yarn, longrope (Phi-3: factor tensors, read later)."""
    stype = a("rope.scaling.type")
    orig = a("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensor_shapes:
        att = a("rope.scaling.attn_factor")
        return {"rope_type": "longrope", "original_max_position_embeddings": int(orig or mpe),
                **({} if att is None else {"attention_factor": float(att)})}
    if stype in (None, "none"):
        return None
    factor = a("rope.scaling.factor")
    if stype == "linear":
        return normalize_rope_scaling({"rope_type": "linear", "factor": float(factor or 1.0)},
                                      max_position_embeddings=mpe)
    if stype == "yarn":
        if a("rope.scaling.yarn_log_multiplier"):
            raise UnsupportedModelError("GGUF rope.scaling.yarn_log_multiplier is not supported")
        d = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig or mpe)}
        for k in ("beta_fast", "beta_slow"):
            if a(f"rope.scaling.yarn_{k}") is not None:
                d[k] = float(a(f"rope.scaling.yarn_{k}"))
        if a("rope.scaling.yarn_attn_factor") not in (None, 1.0):
            d["attention_factor"] = float(a("rope.scaling.yarn_attn_factor"))
        return normalize_rope_scaling(d, max_position_embeddings=mpe)
    raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type {stype!r} is not supported "
                                f"(linear, yarn, longrope)")


def _gguf_config(reader, tensor_shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
    arch = str(_field(reader, "general.architecture", "llama"))
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported "
                                    f"(supported: {', '.join(sorted(_GGUF_ARCHS))})")

    def a(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    kv_heads = a("attention.head_count_kv", heads)
    head_dim = int(a("attention.key_length", hidden // heads))
    layers = int(a("block_count"))
    vocab = a("vocab_size")
    if vocab is None:
        vocab = tensor_shapes["token_embd.weight"][0]
    mpe = int(a("context_length", 4096))
    gemma = arch in ("gemma2", "gemma3")
    window = a("attention.sliding_window")
    layer_types = None
    if window and arch == "gemma2":
        layer_types = tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    elif window and arch == "gemma3":
        pattern = a("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):          # newer llama.cpp: one bool per layer
            layer_types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
        else:
            layer_types = tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                for i in range(layers))
    rot = a("rope.dimension_count")
    # llama.cpp scales Gemma's queries by 1/sqrt(hidden/heads) for the 27B models (46 and 62 layers)
    qpas = None
    if gemma:
        qpas = float(hidden // heads if layers in (46, 62) else head_dim)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ArchConfig(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads if not isinstance(kv_heads, list) else kv_heads[0]),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=mpe,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5)),
        rope_theta=float(a("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        rope_scaling=_gguf_rope(a, arch, mpe, tensor_shapes),
        partial_rotary_factor=(int(rot) / head_dim) if rot else 1.0,
        local_rope_theta=10_000.0 if arch == "gemma3" else None,   # llama.cpp's fixed sliding-layer base
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        o_bias="blk.0.attn_output.bias" in tensor_shapes,
        mlp_bias="blk.0.ffn_down.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        query_pre_attn_scalar=qpas,
        attn_logit_softcap=a("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=a("final_logit_softcapping") if gemma else None,
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in
       (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    **{f"ffn_{n}.{kind}": f"mlp.{n}_proj.{kind}" for n in ("gate", "up", "down") for kind in ("weight", "bias")},
}
# names that differ per architecture (Gemma's four norms; Phi-3's fused gate_up stored as ffn_up)
_GGUF_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
}
_GGUF_ARCH_LAYER_NAMES["gemma3"] = _GGUF_ARCH_LAYER_NAMES["gemma2"]
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor (llama.cpp's names), None for one we do not know."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        hf = _GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(rest) or _GGUF_LAYER_NAMES.get(rest)
        if hf:
            return f"model.layers.{idx}.{hf}"
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
    long_short: dict[str, list[float]] = {}
    gemma = cfg.arch in ("gemma2", "gemma3")
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
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            long_short[t.name.split("_")[2].split(".")[0]] = [float(x) for x in arr.reshape(-1)]
            continue
        hf = gguf_to_hf_name(t.name, cfg.arch) or t.name     # unknown names fail the exact load later
        if gemma and t.name.endswith("norm.weight"):
            arr = arr - 1.0               # llama.cpp stores Gemma's (1 + w); the model adds the 1 back
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            n = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            arr = unpermute_qk(arr, n)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    bar.close()
    if freq_factors is not None:
        cfg = replace(cfg, rope_freq_factors=freq_factors)
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "longrope":
        if set(long_short) != {"long", "short"}:
            raise UnsupportedModelError("GGUF LongRoPE needs rope_factors_long and rope_factors_short")
        cfg = replace(cfg, rope_scaling={**cfg.rope_scaling, "long_factor": long_short["long"],
                                         "short_factor": long_short["short"]})
    return LoadedWeights(cfg, tensors, "gguf", four_bit=n4 * 2 > n_matrices)


# ---------------------------------------------------------------------------------------------
# safetensors + config.json

# HF model_type → our family name (models.FAMILIES)
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
# the keys each RoPE type reads (besides rope_type/type/rope_theta/partial_rotary_factor); any other key
# is a setting we would silently ignore, so it refuses to load
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                       "truncate", "original_max_position_embeddings"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "longrope": frozenset({"factor", "attention_factor", "short_factor", "long_factor",
                           "original_max_position_embeddings"}),
}
_ROPE_COMMON = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def normalize_rope_scaling(d: dict | None, *, max_position_embeddings: int,
                           original_max_position_embeddings: int | None = None,
                           phi3: bool = False) -> dict | None:
    """One RoPE block (legacy `rope_scaling` or transformers-5 `rope_parameters`) → None for plain RoPE
    or {"rope_type": ..., params}; an unknown type or key raises UnsupportedModelError naming it."""
    if not d:
        return None
    d = dict(d)
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "su" or (phi3 and kind == "yarn"):      # Phi-3's old names (transformers maps them too)
        kind = "longrope"
    if kind not in ROPE_KEYS:
        raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported "
                                    f"(supported: {', '.join(sorted(ROPE_KEYS))})")
    unknown = sorted(set(d) - _ROPE_COMMON - ROPE_KEYS[kind])
    if unknown:
        raise UnsupportedModelError(f"RoPE {kind} setting(s) {', '.join(unknown)} are not supported")
    if kind == "default":
        return None
    out = {k: v for k, v in d.items() if k in ROPE_KEYS[kind]}
    out["rope_type"] = kind
    if kind in ("yarn", "llama3", "longrope"):
        orig = original_max_position_embeddings if phi3 and original_max_position_embeddings else None
        out["original_max_position_embeddings"] = int(
            orig or out.get("original_max_position_embeddings") or original_max_position_embeddings
            or max_position_embeddings)
    if kind in ("linear", "dynamic", "llama3") and "factor" not in out:
        raise UnsupportedModelError(f"RoPE {kind} scaling without a factor")
    if kind == "longrope" and not ("short_factor" in out and "long_factor" in out):
        raise UnsupportedModelError("RoPE longrope scaling needs short_factor and long_factor")
    return out


def _hf_rope(hf: dict, arch: str) -> tuple[float, dict | None, float, float | None]:
    """(rope_theta, scaling, partial_rotary_factor, local_rope_theta) from either config form."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or None
    mpe = int(hf.get("max_position_embeddings", 4096))
    orig = hf.get("original_max_position_embeddings")
    local_theta = None
    if arch == "gemma3":
        full = params.get("full_attention") if "full_attention" in params else None
        slide = params.get("sliding_attention") if "sliding_attention" in params else None
        if params and full is None and slide is None:
            full = params                      # one block for every layer
        full = dict(full or {})
        full.update(legacy or {})
        theta = float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
        slide = dict(slide or {})
        local_theta = float(slide.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
        if normalize_rope_scaling(slide, max_position_embeddings=mpe) is not None:
            raise UnsupportedModelError("RoPE scaling on Gemma 3 sliding layers is not supported")
        block = full
    else:
        block = dict(params)
        block.update(legacy or {})
        theta = float(block.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(block.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    scaling = normalize_rope_scaling(block, max_position_embeddings=mpe,
                                     original_max_position_embeddings=orig, phi3=arch == "phi3")
    return theta, scaling, partial, local_theta


def config_from_hf(hf: dict) -> ArchConfig:
    """ArchConfig from an HF config.json dict of a supported family (HF_MODEL_TYPES)."""
    model_type = hf.get("model_type", "llama")
    arch = HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported "
                                    f"(supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    theta, scaling, partial, local_theta = _hf_rope(hf, arch)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if arch in ("gemma2", "gemma3"):
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if arch in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window"):
            window, layer_types = None, None
        elif layer_types is None:
            mwl = int(hf.get("max_window_layers", layers))
            layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    elif arch == "gemma2" and layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif arch == "gemma3" and layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif arch in ("llama",):
        window, layer_types = None, None
    if layer_types is not None:
        bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if bad:
            raise UnsupportedModelError(f"layer type(s) {', '.join(bad)} are not supported")
        if len(layer_types) != layers:
            raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        layer_types = tuple(layer_types)
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention is not supported (a decoder only)")
    bias = bool(hf.get("attention_bias", False))
    return ArchConfig(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        local_rope_theta=local_theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in ("gemma2", "gemma3"))),
        attention_bias=(bias and arch in ("llama", "qwen3", "gemma2", "gemma3")) or arch == "qwen2",
        o_bias=bias and arch in ("llama", "qwen3", "gemma2", "gemma3"),
        mlp_bias=bool(hf.get("mlp_bias", False)) and arch == "llama",
        qk_norm=arch in ("qwen3", "gemma3"),
        hidden_act=act,
        query_pre_attn_scalar=(float(hf.get("query_pre_attn_scalar", 256))
                               if arch in ("gemma2", "gemma3") else None),
        attn_logit_softcap=hf.get("attn_logit_softcapping") if arch in ("gemma2", "gemma3") else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if arch in ("gemma2", "gemma3") else None,
        sliding_window=int(window) if window else None,
        layer_types=layer_types if window else None,
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
