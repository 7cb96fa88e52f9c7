"""`chatserve bench build-gguf`: each shape, run at small dims, writes a GGUF that gguf-py reads with the
tensor types of its format (llama.cpp's Q4_K_M mix included) and that chatserve loads, dequantized and in
place, to the same logits; every format's random weights have the same spread."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from chatserve.bench.gguf_checkpoint import SHAPES, block_scale, build_gguf, tensor_format, use_more_bits
from chatserve_kernels import block_formats

SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512, ffn=512)
MOE = dict(SMALL, experts=8, expert_used=2, expert_ffn=256)


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_use_more_bits_is_llama_cpps_layer_rule():
    # 16 layers: the first and last two, and every third from layer 4 (4 + 3j - 2 ≡ 0 mod 3 → 4, 7, 10, 13)
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                              28, 29, 30, 31]


def test_q4_k_m_mix_as_llama_cpp_writes_it(tmp_path):
    path = build_gguf(tmp_path / "l.gguf", "Q4_K_M", shape="llama-3.2-1b", layers=8, **SMALL)
    types = _types(path)
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types      # tied: the embedding is the head
    more = [i for i in range(8) if use_more_bits(i, 8)]
    assert more and len(more) < 8
    for i in range(8):
        want = "Q6_K" if i in more else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == want and types[f"blk.{i}.ffn_down.weight"] == want
        assert {types[f"blk.{i}.{r}.weight"] for r in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} \
            == {"Q4_K"}
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    r = gguf.GGUFReader(str(path))
    assert int(r.fields["general.file_type"].parts[-1][0]) == 15          # LLAMA_FTYPE_MOSTLY_Q4_K_M
    untied = SHAPES["llama-3.1-8b"]
    assert not untied.tied and tensor_format("Q4_K_M", "output", -1, untied) == "Q6_K"
    assert tensor_format("Q4_K_M", "token_embd", -1, untied) == "Q4_K"


def test_moe_shape_has_qwen3moe_tensors_and_keys(tmp_path):
    path = build_gguf(tmp_path / "m.gguf", "Q4_K_M", shape="qwen3-30b-a3b-2l", **MOE)
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert r.fields["qwen3moe.expert_count"].contents() == 8
    assert r.fields["qwen3moe.expert_used_count"].contents() == 2
    assert r.fields["qwen3moe.attention.key_length"].contents() == 64
    t = {x.name: x for x in r.tensors}
    assert [int(d) for d in t["blk.1.ffn_up_exps.weight"].shape] == [256, 256, 8]      # ggml order: k, n, E
    # 2 layers: n/8 = 0, so layer 1 (≥ 7n/8) gets more bits and layer 0 does not
    assert [t[f"blk.{i}.ffn_down_exps.weight"].tensor_type.name for i in (0, 1)] == ["Q4_K", "Q6_K"]
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    # exactly 8 experts: llama.cpp's Mixtral rule (attn_k/attn_v Q8_0, attn_output Q5_K)
    assert [t[f"blk.0.attn_{r}.weight"].tensor_type.name for r in ("k", "v", "output")] == ["Q8_0", "Q8_0", "Q5_K"]
    assert t["output.weight"].tensor_type.name == "Q6_K" and t["token_embd.weight"].tensor_type.name == "Q4_K"
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= set(t)


@pytest.mark.parametrize("shape,dims", [("llama-3.2-1b", SMALL), ("qwen3-30b-a3b-2l", MOE)])
def test_chatserve_loads_it_dequantized_and_in_place_to_the_same_logits(tmp_path, shape, dims):
    from chatserve.runtime.models.linear_backends import BlockMatrix
    from runtime.hf_checkpoints import prefill_logits

    path = build_gguf(tmp_path / "x.gguf", "Q4_K_M", shape=shape, layers=2, **dims)
    logits = []
    for in_place in (False, True):
        out, tensors, m = prefill_logits(path, in_place)
        assert m.config.arch == SHAPES[shape].arch and m.config.num_layers == 2
        assert (m.config.moe is not None) == bool(SHAPES[shape].experts)
        assert any(isinstance(t, BlockMatrix) for t in tensors.values()) == in_place
        logits.append(out)
    assert torch.isfinite(logits[0]).all() and logits[0].abs().max() > 0
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "F16"])
def test_every_format_spreads_as_q4_0(fmt):
    """A Q8_0 or K-quant file drawn at the Q4_0 file's scale would be 15-300× louder (its codes span more):
    block_scale sizes its scales so the weights' spread is Q4_0's, within the draw's noise."""
    def spread(f: str) -> float:
        w = block_formats.random_weight(f, 256, 1024, seed=7, scale=block_scale(f, 0.004))
        return float(block_formats.dequantize(w).float().std())

    ratio = spread(fmt) / spread("Q4_0")
    assert 0.8 < ratio < 1.25
    assert np.isfinite(ratio)
