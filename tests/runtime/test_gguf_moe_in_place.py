"""--gguf-in-place on a MoE GGUF: the stacked expert tensors [E, n, k] stay in their block format too, as
one view of the mapped file per expert (no dequantized copy of the experts, which are most of a MoE
model's bytes), and the model on them gives the dequantized load's logits."""
from __future__ import annotations

import hf_checkpoints as H
import numpy as np
import pytest
import torch

from chatserve.runtime.models.linear_backends import BlockMatrix
from chatserve.runtime.weights import load_weights


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "qwen2moe"])
def test_stacked_experts_stay_blocks_and_give_the_dense_logits(tmp_path, name):
    path = H.save_gguf(H.hf_model(name), tmp_path / "m.gguf")
    want = H.prefill_logits(path, False)[0]
    got, tensors, _ = H.prefill_logits(path, True)
    experts = {n: t for n, t in tensors.items() if ".experts." in n and "shared" not in n}
    assert experts and all(isinstance(t, BlockMatrix) for t in experts.values())
    n_experts = H.hf_model(name).config.num_local_experts if name == "mixtral" else \
        H.hf_model(name).config.num_experts
    assert any(f".experts.{n_experts - 1}." in n for n in experts)       # one view per expert
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_expert_views_are_the_files_bytes(tmp_path):
    """Each expert's view holds its slice of the stacked tensor, in place (no copy of the map)."""
    import gguf
    path = H.save_gguf(H.hf_model("qwen3moe"), tmp_path / "m.gguf")
    stacked = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up_exps.weight")
    w = load_weights(path, "float32", progress=False, in_place=True)
    e = int(stacked.shape[-1]) - 1
    view = w.tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
    assert isinstance(view, BlockMatrix)
    assert np.array_equal(view.parts[0].data.numpy(), np.asarray(stacked.data).view(np.uint8).reshape(
        int(stacked.shape[-1]), view.n, -1)[e])
    assert not view.parts[0].data.numpy().flags.owndata
