"""The MoE layer (models/moe.py) on real Linear weights: each selected expert runs once a step over all its
rows, a row's output does not depend on the rows beside it, the quantized paths apply to the experts, and
MoE checkpoints load exactly (a missing or extra expert tensor names itself). Families against
transformers: test_families_vs_hf.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_checkpoints as H
from chatserve.runtime.arch_config import UnsupportedModelError
from chatserve.runtime.models import build_model
from chatserve.runtime.models.layers import ALL_GENERATED, ALL_PROMPT, GatedMLP, Linear, RowSplit, TorchOps
from chatserve.runtime.models.moe import MoE
from chatserve.runtime.weights import load_weights

pytest.importorskip("transformers")
H_, I_, E_ = 64, 96, 8


def make_moe(dtype: torch.dtype, quant: str | None, top_k: int = 2, seed: int = 0) -> MoE:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    ops = TorchOps(1e-6)
    experts = [GatedMLP(Linear(rnd(2 * I_, H_), None, quant), Linear(rnd(H_, I_), None, quant), "silu", ops)
               for _ in range(E_)]
    return MoE(Linear(rnd(E_, H_)), experts, top_k, True)


class CallSpy:
    """Wraps an expert: records the row count of each call, runs the real expert."""

    def __init__(self, mlp: GatedMLP) -> None:
        self.mlp, self.calls = mlp, []

    def __call__(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.mlp(x, rows)


def test_each_selected_expert_runs_once_over_all_its_rows():
    moe = make_moe(torch.float32, None)
    moe.experts = [CallSpy(e) for e in moe.experts]
    x = torch.randn(16, H_, generator=torch.Generator().manual_seed(1))
    want = make_moe(torch.float32, None)(x)
    out = moe(x)
    _, idx = moe.route(x)
    routed = torch.bincount(idx.reshape(-1), minlength=E_).tolist()
    assert sum(routed) == 16 * 2 and sum(1 for n in routed if n) > 2
    assert [s.calls for s in moe.experts] == [[n] if n else [] for n in routed]
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_routing_weights_are_the_renormalized_top_k_of_the_softmax():
    moe = make_moe(torch.float32, None, top_k=3)
    router = torch.randn(E_, H_, generator=torch.Generator().manual_seed(5)) * 0.1     # [E, H]
    moe.router = Linear(router.clone())            # the Linear keeps only its packed copy
    x = torch.randn(5, H_, generator=torch.Generator().manual_seed(2))
    w, idx = moe.route(x)
    p = torch.softmax(x @ router.t(), -1)
    ref_w, ref_i = p.topk(3, -1)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True))
    moe.norm = False
    torch.testing.assert_close(moe.route(x)[0], ref_w)


@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, None),
                                         (torch.bfloat16, "int4"), (torch.float32, "int8")])
def test_a_rows_output_does_not_depend_on_the_rows_sharing_its_experts(dtype, quant):
    """Bit-identical alone and in a 40-row step of generated and prompt rows sharing experts, in any
    order: inside each expert's group a generated row keeps the quantized copy and a prompt row the
    dense weight (layers.RowSplit), and each row combines its experts in its own rank order."""
    moe = make_moe(dtype, quant)
    x = torch.randn(40, H_, generator=torch.Generator().manual_seed(3)).to(dtype)
    gen = [i % 3 == 0 for i in range(40)]
    alone = torch.cat([moe(x[i:i + 1], ALL_GENERATED if gen[i] else ALL_PROMPT) for i in range(40)])
    assert torch.equal(moe(x, RowSplit.build(gen, x.device)), alone)
    flip = moe(x.flip(0), RowSplit.build(gen[::-1], x.device)).flip(0)
    assert torch.equal(flip, alone)
    assert torch.equal(moe(x[:12], ALL_PROMPT), torch.cat([moe(x[i:i + 1], ALL_PROMPT) for i in range(12)]))
    _, idx = moe.route(x)
    assert torch.bincount(idx.reshape(-1), minlength=E_).max() > 8          # experts were shared


def test_experts_take_the_quantized_decode_path(tmp_path):
    path = H.save_safetensors(H.hf_model("qwen3moe"), tmp_path / "q")
    w = load_weights(path, "bfloat16", progress=False)
    m = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, weight_quant="int8")
    moe = m.layers[0].mlp
    assert isinstance(moe, MoE) and len(moe.experts) == 8
    assert all(e.gate_up.qw is not None or e.gate_up.wq is not None for e in moe.experts)
    # one decode row reads the router and its top-2 experts' weights, not all eight
    one = moe.bytes_read(1)
    assert moe.router.bytes_read(1) + 2 * moe.experts[0].bytes_read(1) == one < moe.bytes_read(16)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return H.save_safetensors(H.hf_model("mixtral"), tmp_path_factory.mktemp("moe") / "m")


_edited, _build = H.with_tensors, H.build_exact


def test_a_missing_expert_is_a_load_error_naming_it(mixtral_dir, tmp_path):
    def drop(t):
        del t["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(UnsupportedModelError, match=r"lacks .*layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        _build(_edited(mixtral_dir, tmp_path / "m", drop))


def test_an_expert_beyond_the_config_is_a_load_error_naming_it(mixtral_dir, tmp_path):
    def add(t):
        t["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = torch.zeros(48, 64)
    with pytest.raises(UnsupportedModelError, match=r"would not use: .*experts\.8\.w1"):
        _build(_edited(mixtral_dir, tmp_path / "m", add))


def test_transformers_fused_expert_layout_loads_to_the_same_model(mixtral_dir, tmp_path):
    """transformers' in-memory form (mlp.gate, mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])
    reads as the hub's per-expert tensors."""
    def fuse(t):
        for i in range(2):
            p = f"model.layers.{i}.block_sparse_moe."
            gate = [t.pop(p + f"experts.{e}.w1.weight") for e in range(8)]
            up = [t.pop(p + f"experts.{e}.w3.weight") for e in range(8)]
            down = [t.pop(p + f"experts.{e}.w2.weight") for e in range(8)]
            q = f"model.layers.{i}.mlp."
            t[q + "gate.weight"] = t.pop(p + "gate.weight")
            t[q + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            t[q + "experts.down_proj"] = torch.stack(down)
    a, b = _build(mixtral_dir), _build(_edited(mixtral_dir, tmp_path / "m", fuse))
    x = torch.randn(3, 64)
    assert torch.equal(a.layers[1].mlp(x), b.layers[1].mlp(x))


def test_gguf_gating_other_than_softmax_refuses():
    from chatserve.runtime.arch_config import _gguf_moe
    keys = {"expert_count": 8, "expert_used_count": 2, "expert_gating_func": 2}
    with pytest.raises(UnsupportedModelError, match="expert_gating_func 2"):
        _gguf_moe(keys.get, "qwen3moe", 2, 32)
    keys["expert_gating_func"] = 1
    spec = _gguf_moe(keys.get, "qwen3moe", 2, 32)
    assert (spec.num_experts, spec.top_k, spec.expert_size, spec.norm_topk_prob) == (8, 2, 32, True)


def test_stacked_experts_must_match_the_config_count(tmp_path):
    """A GGUF's stacked expert tensors [E, ...] with more experts than expert_count refuse to load."""
    import gguf
    path = H.save_gguf(H.hf_model("qwen3moe"), tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen3moe")
    for f in r.fields.values():
        if f.name.startswith("qwen3moe."):
            key = f.name.split(".", 1)[1]
            val = f.contents()
            if key == "expert_count":
                val = 4
            w.add_key_value(f.name, val, f.types[0] if len(f.types) == 1 else f.types[0],
                            sub_type=f.types[1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape]))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="mlp.experts.gate_proj.weight holds 8 experts, the config 4"):
        _build(str(tmp_path / "bad.gguf"))


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """gpt-oss's hub form: experts as MXFP4 `*_blocks` / `*_scales`. Random codes and exponents, put into
    the reference model through transformers' own dequantizer, match chatserve's logits."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = H.hf_model("gpt_oss", seed=7)
    g = torch.Generator().manual_seed(8)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                E, K, N = p.shape                                                 # x @ W: [E, K, N]
                blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
                scales = torch.randint(122, 126, (E, N, K // 32), dtype=torch.uint8, generator=g)
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    d = H.save_safetensors(model, tmp_path / "m")
    t = load_file(f"{d}/model.safetensors")
    for name in packed:
        t.pop(name.rsplit("_", 1)[0], None)
    save_file({**t, **packed}, f"{d}/model.safetensors", metadata={"format": "pt"})
    assert len(packed) == 4 * model.config.num_hidden_layers
    assert not [n for n in t if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]   # FP4 only
    ours = H.build_exact(d)                       # exact: every _blocks/_scales pair was consumed
    ids = torch.randint(3, 256, (12,), generator=g)
    from chatserve_kernels import AttentionMetadata
    c = ours.config
    caches = [(torch.zeros(4, 8, c.num_kv_heads, c.head_dim), torch.zeros(4, 8, c.num_kv_heads, c.head_dim))
              for _ in range(c.num_layers)]
    meta = AttentionMetadata.build([12], [12], [[0, 1]], 8)
    with torch.inference_mode():
        got = ours.compute_logits(ours.forward(ids, torch.arange(12), caches, meta))
        want = model(ids[None]).logits[0]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("name", ["qwen2moe", "gpt_oss"])
def test_moe_gguf_in_place_gives_the_dense_logits(tmp_path, name):
    """--gguf-in-place keeps a MoE GGUF's 2-D matrices in their block format (attention, the shared expert;
    the router decoded; Qwen2-MoE's stacked experts as per-expert views, gpt-oss's dequantized): the logits
    equal the dequantized load's (test_gguf_moe_in_place.py: the expert views of each family)."""
    from chatserve.runtime.models.linear_backends import BlockMatrix, TorchBlockLinear
    path = H.save_gguf(H.hf_model(name), tmp_path / "m.gguf")
    logits = []
    for in_place in (False, True):
        out, tensors, m = H.prefill_logits(path, in_place)
        assert any(isinstance(t, BlockMatrix) for t in tensors.values()) == in_place
        logits.append(out)
    assert isinstance(m.layers[0].qkv, TorchBlockLinear)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_a_loaded_moe_models_decode_rows_take_cpu_moes_one_call_with_the_loops_bits(tmp_path, name, monkeypatch):
    """A CPU model with int4 experts gets the cpu_moe table per MoE layer (CHATSERVE_MOE_KERNEL=0: none), and
    its generated rows (Qwen2-MoE: plus the shared expert) come out as the expert loop's, bit for bit."""
    from chatserve_kernels import cpu_moe

    if not cpu_moe.available():
        pytest.skip("cpu_moe needs cpu_qmatmul (AVX2 + FMA + F16C)")
    path = H.save_safetensors(H.hf_model(name), tmp_path / "m")
    w = load_weights(path, "bfloat16", progress=False)
    m = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, weight_quant="int4")
    moe = m.layers[0].mlp
    assert isinstance(moe, MoE) and moe.packed is not None
    x = torch.randn(5, w.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = moe(x, ALL_GENERATED)
    packed, moe.packed = moe.packed, None
    torch.testing.assert_close(got, moe(x, ALL_GENERATED), rtol=0, atol=0)
    moe.packed = packed
    monkeypatch.setenv("CHATSERVE_MOE_KERNEL", "0")
    off = build_model(w.config, w.tensors, torch.bfloat16, "cpu", 64, weight_quant="int4").layers[0].mlp
    assert isinstance(off, MoE) and off.packed is None
