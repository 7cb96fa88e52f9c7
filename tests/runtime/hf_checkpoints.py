"""Tiny random checkpoints of every supported family built by transformers itself: its own config
classes and model classes (the reference), saved with save_pretrained (safetensors + config.json) and
as GGUF with the gguf package's writer and tensor-name map, in llama.cpp's conventions (Q/K row
permutation for llama, Gemma norms stored as 1 + w, LongRoPE factors and llama3 frequency factors as
tensors). Nothing here reads chatserve's parsing: a setting chatserve drops shows up as a mismatch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 24          # the sliding window of windowed specs: prompts of 40+ tokens pass it


def _llama3(**kw):
    return dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, **kw)


LONG = [1.0 + 0.25 * i for i in range(8)]
SHORT = [1.0 + 0.05 * i for i in range(8)]
# name → (transformers config class name, kwargs over TINY)
SPECS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_bias": ("Qwen3Config", dict(attention_bias=True)),
    # GGUF has no query_pre_attn_scalar (llama.cpp assumes head_dim except for the 27B models)
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, num_hidden_layers=4,
                                    tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, num_hidden_layers=4,
                                        sliding_window_pattern=2, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        rope_theta=100_000.0, rope_local_base_freq=10_000.0)),
    "gemma3_qpas": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                             num_hidden_layers=3, rope_theta=100_000.0,
                                             rope_local_base_freq=5_000.0)),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "phi3_longrope": ("Phi3Config", dict(pad_token_id=0, original_max_position_embeddings=48,
                                         max_position_embeddings=192, partial_rotary_factor=1.0,
                                         rope_scaling={"rope_type": "longrope", "long_factor": LONG,
                                                       "short_factor": SHORT})),
    "phi4mini": ("Phi3Config", dict(pad_token_id=0, partial_rotary_factor=0.75, tie_word_embeddings=True)),
    # RoPE scalings on Llama (and YaRN on Qwen2, as Qwen2.5's model card sets it)
    "rope_linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "rope_dynamic": ("LlamaConfig", dict(max_position_embeddings=32,
                                         rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "rope_yarn": ("Qwen2Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32})),
    "rope_llama3": ("LlamaConfig", _llama3(rope_theta=500_000.0)),
    "rope_longrope": ("LlamaConfig", dict(rope_scaling={"rope_type": "longrope", "long_factor": LONG[:8],
                                                        "short_factor": SHORT[:8], "factor": 4.0,
                                                        "original_max_position_embeddings": 32})),
    # mixture of experts: 8 experts, top 2 (GGUF: llama.cpp renormalizes the top-k of qwen3moe and
    # Mixtral, never of qwen2moe and olmoe)
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True)),
    "qwen3moe_dense_layers": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                     num_hidden_layers=3, mlp_only_layers=[1],
                                                     attention_bias=True)),
    "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    # attention sinks, sliding and full layers alternating, YaRN (its default RoPE), clamped SwiGLU experts
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                     sliding_window=WINDOW, num_hidden_layers=3)),
    # a SwiGLU limit the random weights reach (llama.cpp, hence GGUF, fixes it at 7)
    "gpt_oss_clamped": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                             sliding_window=WINDOW, num_hidden_layers=3, swiglu_limit=0.9)),
}
MOE_SPECS = ("qwen3moe", "qwen3moe_dense_layers", "qwen2moe", "mixtral", "olmoe", "gpt_oss", "gpt_oss_clamped")
# the spec's phi3 configs derive head_dim from hidden/heads: keep 16
for _n in ("phi3", "phi3_longrope", "phi4mini"):
    SPECS[_n][1]["head_dim"] = None


def hf_config(name: str):
    import transformers
    cls, kw = SPECS[name]
    args = {**TINY, **kw}
    if args.get("head_dim") is None:
        args.pop("head_dim")
    return getattr(transformers, cls)(**args)


def hf_model(name: str, seed: int = 0):
    """A transformers causal LM of the spec (fp32, eager attention, eval), every weight randomized so
    each one matters (norms near their identity, biases nonzero)."""
    import transformers
    cfg = hf_config(name)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").__class__
    model = cls(cfg).eval().float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif n.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 if "gemma" in cls.__name__.lower() else 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if p.dim() == 2 else 0.1))
    return model


def save_safetensors(model, path: Path, legacy_rope: bool = False) -> str:
    """save_pretrained; legacy_rope rewrites config.json's RoPE in the older `rope_scaling` +
    `rope_theta` form (what checkpoints from before transformers 5 carry)."""
    model.save_pretrained(str(path), safe_serialization=True)
    if legacy_rope:
        f = path / "config.json"
        cfg = json.loads(f.read_text())
        rp = cfg.pop("rope_parameters", None) or {}
        if "full_attention" in rp:                     # Gemma 3: per layer type
            full, local = dict(rp["full_attention"]), dict(rp["sliding_attention"])
            cfg["rope_theta"] = full.pop("rope_theta")
            cfg["rope_local_base_freq"] = local.pop("rope_theta")
            rp = full
        else:
            rp = dict(rp)
            cfg["rope_theta"] = rp.pop("rope_theta")
        if "partial_rotary_factor" in rp:
            cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
        if rp.get("rope_type", "default") != "default":
            rp["type"] = rp.pop("rope_type")             # the oldest spelling
            cfg["rope_scaling"] = rp
        f.write_text(json.dumps(cfg, indent=2))
    return str(path)


# ---------------------------------------------------------------------------------------------
# GGUF, as llama.cpp's converter writes it

GGUF_ARCH = {"LlamaForCausalLM": "LLAMA", "MistralForCausalLM": "LLAMA", "Qwen2ForCausalLM": "QWEN2",
             "Qwen3ForCausalLM": "QWEN3", "Gemma2ForCausalLM": "GEMMA2", "Gemma3ForCausalLM": "GEMMA3",
             "Phi3ForCausalLM": "PHI3", "Qwen3MoeForCausalLM": "QWEN3MOE", "Qwen2MoeForCausalLM": "QWEN2MOE",
             "MixtralForCausalLM": "LLAMA", "OlmoeForCausalLM": "OLMOE", "GptOssForCausalLM": "GPT_OSS"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for llama: per head, interleave the two rotate-half halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_gguf(model, path: Path, qtype: str = "F32") -> str:
    """Tensors under llama.cpp's names and keys: F32, or every matrix whose rows are whole blocks in the
    block format qtype (quantized by gguf-py, as llama.cpp's converter does for Q8_0; norms stay F32)."""
    import gguf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = model.config
    arch = gguf.MODEL_ARCH[GGUF_ARCH[type(model).__name__]]
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), name)
    n_layers, heads, kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(cfg.eos_token_id)
    rp = cfg.rope_parameters
    if name == "gemma3":
        rp = rp["full_attention"]
    w.add_rope_freq_base(rp["rope_theta"])
    extra: dict[str, np.ndarray] = {}
    kind = rp.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    elif kind == "llama3":        # llama.cpp bakes llama3 scaling into per-frequency factors
        inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        base = 1.0 / (rp["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        extra["rope_freqs.weight"] = (base / inv).numpy().astype(np.float32)
    elif kind == "longrope":
        extra["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        extra["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        inv, att = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
        w.add_float32(gguf.Keys.Rope.SCALING_ATTN_FACTOR.format(arch=name), att)
    elif kind != "default":
        raise ValueError(f"no GGUF form for RoPE {kind}")
    prf = rp.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        w.add_rope_dimension_count(int(head_dim * prf))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if name == "gemma3":
        w.add_uint32(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=name), 2)
    if name == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    _add_moe_keys(w, cfg)
    nm = gguf.get_tensor_name_map(arch, n_layers)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, t in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if ".experts." in hf_name:                   # stacked [E, ...] as llama.cpp's converter writes
            _add_experts(w, hf_name, t.detach().float().numpy(), name == "gpt-oss", qtype)
            continue
        g = nm.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert g is not None, hf_name
        if not g.endswith((".weight", ".bias")):      # gpt-oss's sinks: llama.cpp loads attn_sinks.weight
            g += ".weight"
        arr = t.detach().float().numpy()
        if name == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            arr = _permute(arr, heads if ".q_proj." in hf_name else kv)
        if name in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            arr = arr + 1.0
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
        if qtype != "F32" and arr.ndim == 2 and arr.shape[1] % block == 0:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(g, arr)
    for k, v in extra.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _add_moe_keys(w, cfg) -> None:
    """llama.cpp's MoE keys: expert counts and sizes (Mixtral and OLMoE experts use feed_forward_length)."""
    n = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not n:
        return
    w.add_expert_count(n)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if hasattr(cfg, "moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if hasattr(cfg, "shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _add_experts(w, hf_name: str, arr: np.ndarray, oss: bool = False, qtype: str = "F32") -> None:
    """transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as GGUF's
    ffn_{gate,up,down}_exps [E, I, H] / [E, H, I], in block format qtype where the rows are whole blocks
    (F32 otherwise). gpt-oss (oss): gate_up_proj [E, H, 2I] with gate and up columns interleaved, down_proj
    [E, I, H], and their _bias tensors (always F32)."""
    import gguf

    def add(g: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype != "F32" and a.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0] == 0:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(g, a)

    blk = f"blk.{hf_name.split('.layers.')[1].split('.')[0]}"
    if oss:
        kind = "bias" if hf_name.endswith("_bias") else "weight"
        if "gate_up_proj" in hf_name:
            gate, up = arr[..., 0::2], arr[..., 1::2]
            if kind == "weight":
                gate, up = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            w.add_tensor(f"{blk}.ffn_gate_exps.{kind}", np.ascontiguousarray(gate, dtype=np.float32))
            w.add_tensor(f"{blk}.ffn_up_exps.{kind}", np.ascontiguousarray(up, dtype=np.float32))
        else:
            down = arr.transpose(0, 2, 1) if kind == "weight" else arr
            w.add_tensor(f"{blk}.ffn_down_exps.{kind}", np.ascontiguousarray(down, dtype=np.float32))
        return
    if hf_name.endswith("gate_up_proj"):
        gate, up = np.split(arr, 2, axis=1)
        add(f"{blk}.ffn_gate_exps.weight", gate)
        add(f"{blk}.ffn_up_exps.weight", up)
    else:
        assert hf_name.endswith("down_proj"), hf_name
        add(f"{blk}.ffn_down_exps.weight", arr)


# ---------------------------------------------------------------------------------------------
# exact-loading helpers: an edited copy of a saved checkpoint, and chatserve's build of one

def with_tensors(src: str, dst: Path, edit) -> str:
    """A copy of the safetensors checkpoint dir src at dst with edit(tensors dict) applied."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(f"{dst}/model.safetensors")
    edit(t)
    save_file(t, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def build_exact(path: str):
    """chatserve's model of the checkpoint (float32, CPU): raises UnsupportedModelError when inexact."""
    from chatserve.runtime.models import build_model
    from chatserve.runtime.weights import load_weights
    w = load_weights(path, "float32", progress=False)
    return build_model(w.config, w.tensors, torch.float32, "cpu", 64)


def prefill_logits(path: str, in_place: bool) -> tuple[torch.Tensor, dict, Any]:
    """A 12-token prefill of the model file at `path` in float32, GGUF block matrices on the torch twin (dense
    when loaded dequantized, in place when in_place): (the last row's logits [1, V], the loaded tensors, the
    model)."""
    from chatserve.runtime.models import build_model
    from chatserve.runtime.models.linear_backends import TorchBlockLinear
    from chatserve.runtime.weights import load_weights
    from chatserve_kernels import AttentionMetadata
    w = load_weights(path, "float32", progress=False, in_place=in_place)
    m = build_model(w.config, w.tensors, torch.float32, "cpu", 64, block_backend=TorchBlockLinear)
    c = m.config
    caches = [(torch.zeros(4, 8, c.num_kv_heads, c.head_dim), torch.zeros(4, 8, c.num_kv_heads, c.head_dim))
              for _ in range(c.num_layers)]
    meta = AttentionMetadata.build([12], [12], [[0, 1]], 8)
    with torch.inference_mode():
        return m.compute_logits(m.forward(torch.arange(3, 15), torch.arange(12), caches, meta)), w.tensors, m
