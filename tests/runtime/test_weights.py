"""Weight loading: GGUF quant types and llama.cpp's Q/K permutation, safetensors (single and sharded),
config parsing (RoPE scaling, bias, tied embeddings), dtypes, and the default model's load time."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from chatserve.runtime.arch_config import UnsupportedModelError, config_from_hf
from chatserve.runtime.weights import load_weights, unpermute_qk
from chatserve.runtime.tiny import make_tiny_model, random_weights, tiny_config

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows: per head, (row i, row i + d/2) become adjacent."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_bytes(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with finite fp16 super-block scales (gguf cannot quantize these)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.full((rows, cols // block, 1), 0.01, dtype=np.float16).view(np.uint8)  # [.., 2]
    if qtype == Q.Q4_K:      # d, dmin at bytes 0..3
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:                    # Q6_K: d at the last 2 bytes
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def write_tiny_gguf(path, cfg: dict, w: dict[str, torch.Tensor], types: dict[str, object]) -> dict:
    """Tiny llama GGUF from HF-named weights: Q/K permuted as llama.cpp does, each tensor in the
    quant type `types` gives (default F32). Returns name → the float32 array the file now encodes."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(hq)
    writer.add_head_count_kv(hkv)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    encoded = {}
    for hf, t in w.items():
        if hf.startswith("model.layers."):
            _, _, i, rest = hf.split(".", 3)
            name = f"blk.{i}.{layer[rest]}"
        else:
            name = names[hf]
        arr = t.float().numpy()
        if "attn_q" in name:
            arr = permute_like_llama_cpp(arr, hq)
        elif "attn_k" in name:
            arr = permute_like_llama_cpp(arr, hkv)
        qtype = types.get(hf, Q.F32)
        if qtype in (Q.Q4_K, Q.Q6_K):
            data = random_kquant_bytes(qtype, arr.shape[0], arr.shape[1], rng)
        elif qtype == Q.F32:
            data = arr
        elif qtype == Q.F16:
            data = arr.astype(np.float16)
        else:
            data = gguf.quants.quantize(arr, qtype)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
        deq = gguf.quants.dequantize(data, qtype).reshape(arr.shape).astype(np.float32)
        if "attn_q" in name:
            deq = unpermute_qk(deq, hq)
        elif "attn_k" in name:
            deq = unpermute_qk(deq, hkv)
        encoded[hf] = deq
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return encoded


GGUF_CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=512)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    for n in (1, 2, 8):
        assert np.array_equal(unpermute_qk(permute_like_llama_cpp(w, n), n), w)
    assert not np.array_equal(permute_like_llama_cpp(w, 8), w)


def test_gguf_every_quant_type_and_qk_permutation(tmp_path):
    cfg = tiny_config("llama", **GGUF_CFG)
    w = random_weights(cfg, seed=5)
    types = {
        "model.embed_tokens.weight": Q.Q8_0,
        "lm_head.weight": Q.BF16,
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
        "model.layers.0.self_attn.v_proj.weight": Q.F16,
        "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
        "model.layers.0.mlp.gate_proj.weight": Q.Q4_K,
        "model.layers.0.mlp.up_proj.weight": Q.Q6_K,
        "model.layers.0.mlp.down_proj.weight": Q.F32,
    }
    path = tmp_path / "tiny.gguf"
    encoded = write_tiny_gguf(path, cfg, w, types)
    got = load_weights(path, "float32", progress=False)
    c = got.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 256, 1, 4, 2, 64)
    assert not c.tie_word_embeddings and c.vocab_size == 512
    assert set(got.tensors) == set(w)
    for name, ref in encoded.items():
        assert got.tensors[name].dtype == torch.float32
        assert np.array_equal(got.tensors[name].numpy(), ref), name
    # the un-permuted Q/K are the original HF rows (up to 4-bit quantization error)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        err = (got.tensors[name] - w[name]).abs().max() / w[name].abs().max()
        assert err < 0.15, (name, float(err))
        corr = torch.corrcoef(torch.stack([got.tensors[name].flatten(), w[name].flatten()]))[0, 1]
        assert corr > 0.99


def test_default_model_config_and_load_time(default_weights):
    c = default_weights.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.hidden_size) == \
        (30, 9, 3, 64, 49152, 576)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_theta == 100000.0
    assert "lm_head.weight" not in default_weights.tensors
    assert default_weights.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    # CPU seconds (one thread): wall time on this shared box also counts other suites' work
    assert default_weights.load_cpu_seconds < 10.0


@pytest.mark.slow
def test_default_qk_match_transformers_gguf_loader(default_weights, default_hf_checkpoint):
    """transformers' own parse of the GGUF (tests/runtime/conftest.py, shared with test_llama_vs_hf.py: its
    config, its Llama class naming the tensors) against ours."""
    cfg, ref = default_hf_checkpoint
    assert cfg["model_type"] == "llama"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(default_weights.tensors[name], ref[name].float()), name


def test_safetensors_sharded_equals_single(tmp_path):
    from safetensors.torch import save_file
    single = make_tiny_model(tmp_path / "one", "qwen2", seed=4, tokenizer=False)
    a = load_weights(single, progress=False)
    sharded = tmp_path / "two"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    names = sorted(a.tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: a.tensors[n].contiguous() for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    b = load_weights(sharded, progress=False)
    assert a.config == b.config and a.config.attention_bias
    assert set(a.tensors) == set(b.tensors)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in names)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_conversion(tmp_path, dtype):
    d = make_tiny_model(tmp_path / "m", "llama", tokenizer=False)
    w = load_weights(d, dtype, progress=False)
    assert all(t.dtype == getattr(torch, dtype) for t in w.tensors.values())


def test_hf_config_parsing():
    base = tiny_config("llama", rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192},
                       rope_theta=500000.0, tie_word_embeddings=True, eos_token_id=[128001, 128009])
    c = config_from_hf(base)
    assert c.rope_scaling["rope_type"] == "llama3" and c.tie_word_embeddings
    assert c.eos_token_ids == (128001, 128009)
    q = config_from_hf(tiny_config("qwen2"))
    assert q.attention_bias and q.arch == "qwen2"
    m = config_from_hf({**tiny_config("llama"), "model_type": "mistral", "head_dim": None})
    assert m.arch == "mistral" and m.head_dim == 64 // 4


def test_unsupported_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / "missing", progress=False)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        config_from_hf({**tiny_config("llama"), "model_type": "gpt2"})


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "RoPE scaling type 'ntk-by-parts' is not supported"),
    ({"type": "yarn", "factor": 4.0, "wiggle": 1}, "RoPE yarn setting\\(s\\) wiggle are not supported"),
    ({"rope_type": "linear"}, "linear scaling without a factor"),
])
def test_unknown_rope_settings_refuse_to_load_in_both_config_forms(rope, message):
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf(tiny_config("llama", rope_scaling=rope))
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf(tiny_config("llama", rope_parameters={"rope_theta": 10000.0, **rope}))


def test_yarn_is_kept_in_both_config_forms():
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    old = config_from_hf(tiny_config("qwen2", rope_scaling=yarn, max_position_embeddings=32768))
    new = config_from_hf(tiny_config("qwen2", max_position_embeddings=32768,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 32768}))
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}
