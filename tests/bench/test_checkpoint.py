"""`chatserve bench build-model`: the Llama-3.2-1B-shaped builder, run at small dims, writes a standard
HF dir that chatserve's loader runs with the logits transformers computes from the same files."""
from __future__ import annotations

import json

import pytest
import torch

from chatserve.bench.checkpoint import build_checkpoint, checkpoint_config

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("shape") / "llama-small", "llama-3.2-1b", seed=3,
                            progress=False, **SMALL)


def test_writes_a_standard_hf_dir(small_dir):
    names = {f.name for f in small_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    cfg = json.loads((small_dir / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_theta"] == 500000.0
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152
    assert json.loads((small_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_chatserve_loads_it_and_matches_transformers(small_dir):
    from transformers import LlamaForCausalLM

    from chatserve.runtime.kv_cache import allocate_kv_caches
    from chatserve.runtime.models import build_model
    from chatserve.runtime.weights import load_weights
    from chatserve.text import Tokenizer
    from chatserve_kernels import AttentionMetadata

    w = load_weights(small_dir, "float32", progress=False)
    assert w.source == "safetensors" and w.config.tie_word_embeddings
    assert w.config.rope_scaling and w.config.rope_scaling["rope_type"] == "llama3"
    assert (w.config.num_heads, w.config.num_kv_heads, w.config.head_dim) == (4, 2, 16)
    ids = Tokenizer.from_model(str(small_dir)).encode("The quick brown fox jumps over the lazy dog")
    assert len(ids) > 5
    model = build_model(w.config, w.tensors, torch.float32, "cpu", 2048)
    n = -(-len(ids) // 16)
    kv = allocate_kv_caches(model.config, 16, torch.float32, num_blocks=n)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n))], 16)
    ref_model = LlamaForCausalLM.from_pretrained(str(small_dir), torch_dtype=torch.float32)
    with torch.inference_mode():
        ours = model.compute_logits(model.forward(torch.tensor(ids), torch.arange(len(ids)), kv, meta))
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    assert ref.abs().max() > 0
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-3


def test_second_build_reuses_the_dir(small_dir):
    assert "rope_theta" not in checkpoint_config("llama-3.2-1b")["rope_scaling"]   # not mutated by a build
    before = (small_dir / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint(small_dir, "llama-3.2-1b", seed=3, progress=False, **SMALL) == small_dir
    assert (small_dir / "model.safetensors").stat().st_mtime_ns == before


def test_full_shape_is_llama_3_2_1b():
    cfg = checkpoint_config("llama-3.2-1b")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (2048, 16, 8192)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 8, 64)
    with pytest.raises(ValueError, match="shape"):
        checkpoint_config("llama-9b")


def test_the_moe_shape_builds_and_loads_as_qwen3_moe(tmp_path):
    """Qwen3-30B-A3B's routing (128 experts, top 8, renormalized) at small dims: chatserve reads it as a
    MoE on every layer."""
    from chatserve.runtime.models import build_model
    from chatserve.runtime.models.moe import MoE
    from chatserve.runtime.weights import load_weights

    d = build_checkpoint(tmp_path / "moe-small", "qwen3-30b-a3b-2l", seed=1, progress=False,
                         **{**SMALL, "moe_intermediate_size": 16})
    w = load_weights(d, "bfloat16", progress=False)
    spec = w.config.moe
    assert (w.config.arch, spec.num_experts, spec.top_k, spec.norm_topk_prob) == ("qwen3moe", 128, 8, True)
    m = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64)
    assert all(isinstance(ly.mlp, MoE) and len(ly.mlp.experts) == 128 for ly in m.layers)
