"""--gguf-in-place on a MoE GGUF: the stacked expert tensors [E, n, k] stay in their block format too, as
one view of the mapped file per expert (no dequantized copy of the experts, which are most of a MoE
model's bytes), and the model on them gives the dequantized load's logits."""
from __future__ import annotations

import hf_checkpoints as H
import numpy as np
import pytest
import torch
from test_gguf_in_place import mapped

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


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "qwen2moe"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("tiled", ["1", "0"])
def test_in_place_experts_take_one_c_call_with_the_loops_bits(tmp_path, name, qtype, tiled, monkeypatch):
    """On the CPU backend, every MoE layer of a GGUF loaded in place gets the cpu_moe_block table (its
    experts' tiled decode copies with CHATSERVE_MOE_TILED=1, their views of the file with 0), its generated
    rows go through that one call (counted), and they come out as the expert loop's, bit for bit
    (CHATSERVE_MOE_KERNEL=0: no table). The tiny Mixtral's expert width (48) is no whole number of blocks: its
    down stays F32 (the float path), so it gets no table."""
    monkeypatch.setenv("CHATSERVE_MOE_TILED", tiled)
    from chatserve.runtime.models import build_model
    from chatserve.runtime.models.layers import ALL_GENERATED
    from chatserve.runtime.models.linear_backends import choose_block_backend
    from chatserve.runtime.models.moe import MoE
    from chatserve_kernels import cpu_moe_block

    backend = choose_block_backend(torch.device("cpu"))
    isa = getattr(backend, "isa", "")
    if not isa or not cpu_moe_block.available(isa):
        pytest.skip("cpu_moe_block needs a cpu_blockq8 level")
    path = H.save_gguf(H.hf_model(name), tmp_path / "m.gguf", qtype)
    w = load_weights(path, "bfloat16", progress=False, in_place=True)
    m = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, block_backend=backend)
    moes = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoE)]
    if name == "mixtral":
        assert moes and all(moe.packed is None for moe in moes)
        return
    assert moes and all(isinstance(moe.packed, cpu_moe_block.BlockExperts) for moe in moes)
    assert all(moe.packed.tiled == (tiled == "1") for moe in moes if isinstance(moe.packed, cpu_moe_block.BlockExperts))
    calls = []
    real = cpu_moe_block.moe
    monkeypatch.setattr(cpu_moe_block, "moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    for moe in moes:
        for T in (1, 4):
            x = torch.randn(T, w.config.hidden_size, generator=g).bfloat16()
            before = len(calls)
            got = moe(x, ALL_GENERATED)
            assert len(calls) == before + 1
            packed, moe.packed = moe.packed, None
            try:
                want = moe(x, ALL_GENERATED)
            finally:
                moe.packed = packed
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    monkeypatch.setenv("CHATSERVE_MOE_KERNEL", "0")
    off = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, block_backend=backend)
    assert all(layer.mlp.packed is None for layer in off.layers if isinstance(layer.mlp, MoE))


def test_experts_get_tiled_copies_when_they_fit_a_quarter_of_memory(tmp_path, monkeypatch):
    """CHATSERVE_MOE_TILED unset: a model's experts are tiled when every MoE layer's weights (a byte each) fit a
    quarter of the machine's memory, not when they would not (a 30B-A3B's 29 G weights on a small box); 1 and 0
    force it either way."""
    from chatserve.runtime.models import build_model
    from chatserve.runtime.models import decoder
    from chatserve.runtime.models.linear_backends import choose_block_backend

    path = H.save_gguf(H.hf_model("qwen3moe"), tmp_path / "m.gguf", "Q8_0")
    w = load_weights(path, "bfloat16", progress=False, in_place=True)
    m = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, block_backend=choose_block_backend(torch.device("cpu")))
    spec = w.config.moe
    assert spec is not None
    weights = sum(spec.sparse_layers) * spec.num_experts * 3 * spec.expert_size * w.config.hidden_size
    monkeypatch.delenv("CHATSERVE_MOE_TILED", raising=False)
    page = decoder.os.sysconf("SC_PAGE_SIZE")
    for pages, want in ((4 * weights // page + 1, True), (4 * weights // page - 1, False)):
        monkeypatch.setattr(decoder.os, "sysconf", lambda name, p=pages: page if name == "SC_PAGE_SIZE" else p)
        assert m.tile_experts() is want
    monkeypatch.setenv("CHATSERVE_MOE_TILED", "1")
    assert m.tile_experts() is True
    monkeypatch.setenv("CHATSERVE_MOE_TILED", "0")
    assert m.tile_experts() is False


def test_tiled_experts_are_kept_in_the_cache_file_and_mapped_by_a_second_load(tmp_path, monkeypatch):
    """CHATSERVE_MOE_TILED=1: the experts' tiled copies go to the GGUF's tiled cache file like the dense layers'
    (a first load writes them, a second maps them and tiles nothing: its load does not redo that work), with
    the same bits."""
    from chatserve.runtime.models import build_model
    from chatserve.runtime.models.layers import ALL_GENERATED
    from chatserve.runtime.models.linear_backends import choose_block_backend
    from chatserve.runtime.models.moe import MoE
    from chatserve_kernels import cpu_blockq8, env

    backend = choose_block_backend(torch.device("cpu"))
    if not getattr(backend, "isa", "") or not cpu_blockq8.available(backend.isa):
        pytest.skip("tiled copies need a cpu_blockq8 level")
    monkeypatch.setenv("CHATSERVE_MOE_TILED", "1")
    monkeypatch.setenv(env.WEIGHT_CACHE, "1")
    monkeypatch.setenv(env.WEIGHT_CACHE_DIR, str(tmp_path / "cache"))
    path = H.save_gguf(H.hf_model("qwen3moe"), tmp_path / "m.gguf", "Q8_0")
    x = torch.randn(3, H.hf_model("qwen3moe").config.hidden_size, generator=torch.Generator().manual_seed(1))
    outs, stores = [], []
    for _ in range(2):
        w = load_weights(path, "bfloat16", progress=False, in_place=True)
        m = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, block_backend=backend)
        assert w.tiled_store is not None
        w.tiled_store.finish()
        moes = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoE)]
        assert moes
        outs.append([moe(x.bfloat16(), ALL_GENERATED) for moe in moes])
        stores.append(w.tiled_store)
        tiles = [t for moe in moes for e in moe.experts for lin in (e.gate_up, e.down)
                 for _, t in lin.decode_calls if isinstance(t, cpu_blockq8.TiledWeight)]
        assert len(tiles) == 2 * sum(len(moe.experts) for moe in moes)
        ranges = mapped(str(w.tiled_store.path))                             # in the cache file's pages
        assert ranges and all(any(lo <= t.data.data_ptr() and t.data.data_ptr() + t.data.numel() <= hi
                                  for lo, hi in ranges) for t in tiles)
    first, second = stores
    assert first.built > 0 and second.mapped and second.built == 0 and not second.stale
    assert all(torch.equal(a, b) for a, b in zip(*outs))

