"""RoPE tables (models.rope) against transformers' own frequency functions, each config built by
transformers' config classes and read back through chatserve's config parsing."""
from __future__ import annotations

import pytest
import torch

from chatserve.runtime.models.rope import angles, rope_tables
from chatserve.runtime.arch_config import config_from_hf

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=64,
            num_hidden_layers=1, vocab_size=32, max_position_embeddings=4096, rope_theta=500_000.0)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "longrope": {"rope_type": "longrope", "long_factor": [1.0 + i / 8 for i in range(32)],
                 "short_factor": [1.0 + i / 64 for i in range(32)], "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_attention_factor_match_transformers(name):
    s = SCALINGS[name]
    hf = transformers.LlamaConfig(**BASE, rope_scaling=dict(s))
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS[s["rope_type"]](hf, "cpu", seq_len=4096)   # long factors
    cfg = config_from_hf(hf.to_dict())
    ang, att = angles(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, 4096, cfg.max_position_embeddings)
    assert torch.allclose(ang[1], ref_inv.float(), rtol=1e-6)          # position 1: the frequencies
    assert att == pytest.approx(ref_att, rel=1e-6)
    cos, sin = rope_tables(cfg, 8)
    assert cos.shape == (8, cfg.head_dim) and float(cos[0].max()) == pytest.approx(ref_att, rel=1e-6)


def test_dynamic_ntk_rotates_each_position_with_the_base_of_its_own_length():
    hf = transformers.LlamaConfig(**{**BASE, "max_position_embeddings": 64},
                                  rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    cfg = config_from_hf(hf.to_dict())
    ang, _ = angles(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, 200, 64)
    for p in (10, 63, 64, 150):
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=p + 1)   # as transformers decodes p
        assert torch.allclose(ang[p], p * inv.float(), rtol=1e-5), p


def test_longrope_short_factors_when_the_served_context_fits_the_original():
    s = SCALINGS["longrope"]
    hf = transformers.LlamaConfig(**BASE, rope_scaling=dict(s))
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=100)
    cfg = config_from_hf(hf.to_dict())
    ang, _ = angles(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, 1024, cfg.max_position_embeddings)
    assert torch.allclose(ang[1], short.float(), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_built_in_chunks_equal_one_pass_over_all_positions(dtype):
    """rope_tables writes its tables chunk by chunk in their final dtype: the same bits as the whole-table
    formula (cos·att and sin·att in float32, rounded once), across chunk edges."""
    hf = transformers.LlamaConfig(**BASE, rope_scaling=dict(SCALINGS["yarn"]))      # att != 1
    cfg = config_from_hf(hf.to_dict())
    n = 2 * 4096 + 77
    ang, att = angles(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, n, cfg.max_position_embeddings)
    assert att != 1.0
    c, s = (ang.cos() * att), (ang.sin() * att)
    cos, sin = rope_tables(cfg, n, dtype=dtype)
    assert cos.dtype == dtype and cos.shape == (n, cfg.head_dim)
    assert torch.equal(cos, torch.cat([c, c], -1).to(dtype)) and torch.equal(sin, torch.cat([-s, s], -1).to(dtype))
