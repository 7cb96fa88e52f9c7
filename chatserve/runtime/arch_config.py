"""Architecture hyperparameters (`ArchConfig`) parsed from an HF config.json dict or a GGUF file's
metadata, with the RoPE scaling block normalized. No tensors and no torch: loading them is weights.py.
"""
from __future__ import annotations

from typing import Any, Callable

from dataclasses import dataclass, field

# GGUF architectures we run, and whether llama.cpp's converter permuted their Q/K rows.
GGUF_ARCHS: dict[str, bool] = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False,
                               "gemma2": False, "gemma3": False, "phi3": False, "qwen2moe": False,
                               "qwen3moe": False, "olmoe": False, "mixtral": True, "gpt-oss": False}
# our MoE families (ArchConfig.arch) → whether the router's top-k weights are renormalized where the config
# cannot say: Mixtral always; from GGUF, llama.cpp's fixed choice per architecture
# gpt-oss takes the softmax of the top-k logits: the same weights as the renormalized top-k of the softmax
MOE_NORM_TOPK: dict[str, bool] = {"mixtral": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False,
                                  "gpt-oss": True}


class UnsupportedModelError(ValueError):
    """A checkpoint chatserve cannot run exactly: an unknown architecture or setting, or tensors the
    model would leave unused or miss. Its message is one line meant for the operator."""


@dataclass(frozen=True)
class MoESpec:
    """Which layers route each token to top_k of num_experts SwiGLU experts (softmax over the router's
    logits, then the top k, renormalized to sum to 1 when norm_topk_prob), and their sizes."""

    num_experts: int
    top_k: int
    expert_size: int                    # intermediate size of one expert
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]     # per layer: True = MoE, False = the dense MLP (intermediate_size)
    shared_expert_size: int = 0         # Qwen2-MoE: an expert every token takes, scaled by sigmoid(x·g)
    biases: bool = False                # gpt-oss: the router and every expert matrix have biases
    swiglu_oai: tuple[float, float] | None = None   # gpt-oss's clamped SwiGLU: (alpha, limit)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(f"MoE top-k {self.top_k} of {self.num_experts} experts")


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
    rope_scaling: dict[str, Any] | None = None   # normalized: {"rope_type": linear|dynamic|yarn|llama3|longrope, ...}
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs` (llama3 scaling baked in)
    partial_rotary_factor: float = 1.0      # Phi-4-mini: only the first 3/4 of each head is rotated
    local_rope_theta: float | None = None   # Gemma 3: sliding layers' own base (and no scaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Q/K/V projections have biases (Qwen2; Llama attention_bias)
    o_bias: bool = False                    # o_proj has a bias (Llama attention_bias)
    mlp_bias: bool = False                  # gate/up/down have biases (Llama mlp_bias)
    qk_norm: bool = False                   # RMSNorm of q and k before RoPE: per head (Qwen3, Gemma 3) or
                                            # over all heads (OLMoE; the norm weight's size tells)
    hidden_act: str = "silu"                # silu | gelu_pytorch_tanh (Gemma's GeGLU)
    query_pre_attn_scalar: float | None = None   # Gemma: scores scaled by this ** -0.5, not head_dim
    attn_logit_softcap: float | None = None      # Gemma 2: scores = c·tanh(scores / c)
    attention_sinks: bool = False                # gpt-oss: a learned logit per head in each softmax's denominator
    final_logit_softcap: float | None = None     # Gemma 2: logits = c·tanh(logits / c)
    sliding_window: int | None = None       # a token sees the last N positions (itself included)
    layer_types: tuple[str, ...] | None = None   # per layer "sliding_attention" | "full_attention";
                                                 # None: every layer slides when sliding_window is set
    moe: MoESpec | None = None              # mixture-of-experts layers (models/moe.py)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

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
        known = [w for w in windows if w is not None]
        return None if not windows or len(known) < len(windows) else max(known)


# ---------------------------------------------------------------------------------------------
# GGUF metadata

MetaGetter = Callable[..., Any]     # a(key, default=None): one metadata value of the file's architecture


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _gguf_rope(a: MetaGetter, arch: str, mpe: int, tensor_shapes: dict[str, Any]) -> dict[str, Any] | None:
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
        if arch == "gpt-oss":          # its reference (OpenAI's, transformers') leaves the YaRN bounds unrounded
            d["truncate"] = False
        return normalize_rope_scaling(d, max_position_embeddings=mpe)
    raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type {stype!r} is not supported "
                                f"(linear, yarn, longrope)")


def _gguf_layer_types(a: MetaGetter, arch: str, layers: int) -> tuple[str, ...] | None:
    """Gemma's alternation of sliding and full layers (llama.cpp keeps only the pattern); None for
    families whose every layer slides."""
    if arch in ("gemma2", "gpt-oss"):
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    if arch == "gemma3":
        pattern = a("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):          # newer llama.cpp: one bool per layer
            return tuple("sliding_attention" if p else "full_attention" for p in pattern)
        return tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers))
    return None


def _gguf_moe(a: MetaGetter, arch: str, layers: int, ffn: int) -> MoESpec | None:
    """The MoE spec from llama.cpp's keys: every layer is a MoE layer, and the top-k renormalization is
    llama.cpp's fixed choice per architecture (MOE_NORM_TOPK). ffn: feed_forward_length."""
    if arch not in MOE_NORM_TOPK:
        return None
    gating = a("expert_gating_func")
    if gating not in (None, 1):                       # llama.cpp: 1 = softmax, 2 = sigmoid
        raise UnsupportedModelError(f"GGUF expert_gating_func {gating} is not supported (softmax)")
    oss = arch == "gpt-oss"             # llama.cpp's fixed clamped SwiGLU: alpha 1.702, limit 7
    return MoESpec(int(a("expert_count")), int(a("expert_used_count")),
                   int(a("expert_feed_forward_length", ffn)), MOE_NORM_TOPK[arch], (True,) * layers,
                   int(a("expert_shared_feed_forward_length", 0)) if arch == "qwen2moe" else 0,
                   biases=oss, swiglu_oai=(1.702, 7.0) if oss else None)


def gguf_config(reader: Any, tensor_shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
    """ArchConfig from a GGUFReader's metadata; tensor_shapes (GGUF name → numpy shape) tells which
    optional tensors (biases, norms, an untied output) the file has."""
    arch = str(_field(reader, "general.architecture", "llama"))
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported "
                                    f"(supported: {', '.join(sorted(GGUF_ARCHS))})")

    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{gguf_arch}.{key}", default)

    gguf_arch = arch
    if arch == "llama" and a("expert_count"):          # llama.cpp writes Mixtral as llama with experts
        arch = "mixtral"

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
    layer_types = _gguf_layer_types(a, arch, layers) if window else None
    rot = a("rope.dimension_count")
    ffn = int(a("feed_forward_length", a("expert_feed_forward_length", 0)))
    # llama.cpp scales Gemma's queries by 1/sqrt(hidden/heads) for the 27B models (46 and 62 layers)
    qpas = None
    if gemma:
        qpas = float(hidden // heads if layers in (46, 62) else head_dim)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ArchConfig(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=ffn,
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
        attention_sinks="blk.0.attn_sinks.weight" in tensor_shapes,
        final_logit_softcap=a("final_logit_softcapping") if gemma else None,
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        moe=_gguf_moe(a, arch, layers, ffn),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


# ---------------------------------------------------------------------------------------------
# HF config.json

# HF model_type → our family name (models.FAMILIES)
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "qwen2_moe": "qwen2moe",
                  "qwen3_moe": "qwen3moe", "mixtral": "mixtral", "olmoe": "olmoe", "gpt_oss": "gpt-oss"}
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


def normalize_rope_scaling(d: dict[str, Any] | None, *, max_position_embeddings: int,
                           original_max_position_embeddings: int | None = None,
                           phi3: bool = False) -> dict[str, Any] | None:
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


def _hf_rope(hf: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float, float | None]:
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


def _hf_sliding(hf: dict[str, Any], arch: str, layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as each family's config spells them; layer_types None means every
    layer slides when a window is set."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        if not hf.get("use_sliding_window"):
            window, layer_types = None, None
        elif layer_types is None and arch != "qwen3moe":      # Qwen3-MoE slides on every layer
            mwl = int(hf.get("max_window_layers", layers))
            layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    elif arch == "gemma2" and layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif arch == "gemma3" and layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif arch in ("llama", "olmoe"):
        window, layer_types = None, None
    if layer_types is None:
        return window, None
    bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if bad:
        raise UnsupportedModelError(f"layer type(s) {', '.join(bad)} are not supported")
    if len(layer_types) != layers:
        raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {layers} layers")
    return window, tuple(layer_types)


def _hf_moe(hf: dict[str, Any], arch: str, layers: int) -> MoESpec | None:
    """The MoE spec of an HF config of a MoE family (None for a dense family)."""
    if arch not in MOE_NORM_TOPK:
        return None
    # transformers 5 saves num_experts as num_local_experts (Mixtral's name) for every family
    n = int(hf.get("num_experts", hf.get("num_local_experts")) or 0)
    if arch == "mixtral":
        return MoESpec(n, int(hf["num_experts_per_tok"]),
                       int(hf["intermediate_size"]), True, (True,) * layers)
    if arch == "gpt-oss":
        return MoESpec(n, int(hf["num_experts_per_tok"]), int(hf["intermediate_size"]), True, (True,) * layers,
                       biases=True, swiglu_oai=(float(hf.get("swiglu_alpha", 1.702)),
                                                float(hf.get("swiglu_limit", 7.0))))
    if arch == "olmoe":
        if hf.get("clip_qkv") is not None:
            raise UnsupportedModelError("OLMoE clip_qkv is not supported")
        return MoESpec(n, int(hf["num_experts_per_tok"]), int(hf["intermediate_size"]),
                       bool(hf.get("norm_topk_prob", False)), (True,) * layers)
    # Qwen2-MoE / Qwen3-MoE: decoder_sparse_step and mlp_only_layers pick the MoE layers
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(n > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
    if not any(sparse):
        raise UnsupportedModelError(f"{hf.get('model_type')} config without MoE layers")
    return MoESpec(n, int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]),
                   bool(hf.get("norm_topk_prob", False)), sparse,
                   int(hf.get("shared_expert_intermediate_size", 0)) if arch == "qwen2moe" else 0)


def config_from_hf(hf: dict[str, Any]) -> ArchConfig:
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
    window, layer_types = _hf_sliding(hf, arch, layers)
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention is not supported (a decoder only)")
    bias = bool(hf.get("attention_bias", False))
    biased = ("llama", "qwen3", "gemma2", "gemma3", "qwen3moe", "olmoe", "gpt-oss")
    qkv_bias = (bias and arch in biased) or arch == "qwen2" \
        or (arch == "qwen2moe" and hf.get("qkv_bias", True))
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
        attention_bias=bool(qkv_bias),
        o_bias=bias and arch in biased,
        mlp_bias=bool(hf.get("mlp_bias", False)) and arch == "llama",
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "olmoe"),
        hidden_act=act,
        query_pre_attn_scalar=(float(hf.get("query_pre_attn_scalar", 256))
                               if arch in ("gemma2", "gemma3") else None),
        attn_logit_softcap=hf.get("attn_logit_softcapping") if arch in ("gemma2", "gemma3") else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if arch in ("gemma2", "gemma3") else None,
        attention_sinks=arch == "gpt-oss",
        sliding_window=int(window) if window else None,
        layer_types=layer_types if window else None,
        moe=_hf_moe(hf, arch, layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
