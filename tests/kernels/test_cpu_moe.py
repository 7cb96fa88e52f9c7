"""cpu_moe (one C call per MoE layer for decode rows) against the expert loop it replaces (models/moe.py over
layers.Linear on cpu_qmatmul, cpu_ops' SiLU·mul): the same bits at every row count, bit width and dtype; a
row's result independent of the rows beside it and of which of them share its experts; near its plain-torch
twin (dequantized weights, float32 matmuls); and the MoE layer's dispatch (generated rows through the call,
prompt rows through the loop, shared expert added after)."""
from __future__ import annotations

import pytest
import torch

from chatserve_kernels import cpu_build, cpu_moe
from chatserve_kernels import cpu_qmatmul as Q
from chatserve.runtime.models.layers import ALL_GENERATED, ALL_PROMPT, FusedCpuOps, GatedMLP, Linear, RowSplit, TorchOps
from chatserve.runtime.models.moe import MoE, packed_experts

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason=str(cpu_build.status("cpu_qmatmul")))
H_, I_, E_ = 128, 96, 8


def make_moe(dtype: torch.dtype, quant: str, top_k: int = 3, seed: int = 0, shared: bool = False) -> MoE:
    """A MoE layer with packed experts (moe.packed set) on FusedCpuOps, as a CPU model builds it."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    ops = FusedCpuOps(1e-6)

    def mlp() -> GatedMLP:
        return GatedMLP(Linear(rnd(2 * I_, H_), None, quant), Linear(rnd(H_, I_), None, quant), "silu", ops)
    experts = [mlp() for _ in range(E_)]
    sh, gate = (mlp(), Linear(rnd(1, H_))) if shared else (None, None)
    moe = MoE(Linear(rnd(E_, H_)), experts, top_k, True, sh, gate, packed_experts(experts, "silu", ops))
    assert moe.packed is not None
    return moe


def loop(moe: MoE, x: torch.Tensor, rows: RowSplit | None = ALL_GENERATED) -> torch.Tensor:
    """The same layer through its expert loop (the oracle the C call must match bit for bit)."""
    packed, moe.packed = moe.packed, None
    try:
        return moe(x, rows)
    finally:
        moe.packed = packed


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_one_call_gives_the_expert_loops_bits(quant, dtype, top_k):
    moe = make_moe(dtype, quant, top_k)
    g = torch.Generator().manual_seed(1)
    for T in (1, 2, 5, 9, 16):                  # row blocks of 1/2/4/8 inside an expert's group, and mixes
        x = torch.randn(T, H_, generator=g).to(dtype)
        w, idx = moe.route(x)
        got = cpu_moe.moe(x, idx, w, moe.packed)
        assert got.dtype == dtype and got.shape == (T, H_)
        torch.testing.assert_close(got, loop(moe, x), rtol=0, atol=0)
        torch.testing.assert_close(moe(x, ALL_GENERATED), got, rtol=0, atol=0)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(quant):
    """Alone, in a batch, in another order, beside copies of itself (all its experts then shared by
    several rows): the same bits."""
    moe = make_moe(torch.bfloat16, quant, top_k=4)
    x = torch.randn(12, H_, generator=torch.Generator().manual_seed(2)).bfloat16()
    w, idx = moe.route(x)
    batch = cpu_moe.moe(x, idx, w, moe.packed)
    for t in range(12):
        alone = cpu_moe.moe(x[t:t + 1], idx[t:t + 1], w[t:t + 1], moe.packed)
        torch.testing.assert_close(alone[0], batch[t], rtol=0, atol=0)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(cpu_moe.moe(x[perm], idx[perm], w[perm], moe.packed), batch[perm], rtol=0, atol=0)
    rep = torch.tensor([5, 5, 5, 0, 5])                                 # row 5 four times: its experts shared
    torch.testing.assert_close(cpu_moe.moe(x[rep], idx[rep], w[rep], moe.packed), batch[rep], rtol=0, atol=0)


def test_more_threads_give_the_same_bits():
    moe = make_moe(torch.bfloat16, "int4", top_k=8)
    x = torch.randn(7, H_, generator=torch.Generator().manual_seed(4)).bfloat16()
    w, idx = moe.route(x)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_moe.moe(x, idx, w, moe.packed)
        torch.set_num_threads(3)
        torch.testing.assert_close(cpu_moe.moe(x, idx, w, moe.packed), one, rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_near_the_plain_torch_twin(quant):
    """Against float32 matmuls on the dequantized codes: the C call differs by its quantized activations
    (15-bit codes per group of 32 for 4-bit weights, 8-bit for 8-bit ones) and, in bf16, its roundings."""
    moe = make_moe(torch.float32, quant, top_k=3)
    pk = moe.packed
    assert pk is not None

    def dense(lin: Linear) -> torch.Tensor:
        assert lin.w is not None or lin.packed is not None
        codes, scale, lo = Q.quantize(lin.w if lin.w is not None else lin.packed.to_dense(), pk.bits)
        return Q.dequantize(codes, scale, lo)
    twin = [(dense(e.gate_up), dense(e.down)) for e in moe.experts]
    x = torch.randn(6, H_, generator=torch.Generator().manual_seed(5))
    w, idx = moe.route(x)
    got = cpu_moe.moe(x, idx, w, pk)
    ref = cpu_moe.reference(x, idx, w, twin)
    # x's codes err by 1/32639 (4-bit weights) or 1/127 (8-bit) of a group's max, through two matmuls
    rel = 2e-3 if quant == "int4" else 5e-2
    assert float((got - ref).abs().max()) <= rel * float(ref.abs().max()), float((got - ref).abs().max())


def test_a_mixed_step_sends_generated_rows_through_the_call_and_prompt_rows_through_the_loop():
    moe = make_moe(torch.bfloat16, "int4", top_k=2, shared=True)
    x = torch.randn(6, H_, generator=torch.Generator().manual_seed(6)).bfloat16()
    rows = RowSplit.build([True, False, True, True, False, False], x.device)
    got = moe(x, rows)
    torch.testing.assert_close(got, loop(moe, x, rows), rtol=0, atol=0)
    gen, prompt = rows.gen, rows.prompt
    assert gen is not None and prompt is not None
    torch.testing.assert_close(got[gen], moe(x[gen], ALL_GENERATED), rtol=0, atol=0)
    torch.testing.assert_close(got[prompt], loop(moe, x[prompt], ALL_PROMPT), rtol=0, atol=0)


def test_rows_none_takes_the_call_up_to_small_m_rows():
    moe = make_moe(torch.bfloat16, "int4")
    x = torch.randn(moe.small_m, H_, generator=torch.Generator().manual_seed(7)).bfloat16()
    torch.testing.assert_close(moe(x, None), loop(moe, x, None), rtol=0, atol=0)


def test_no_table_where_the_call_would_not_give_the_loops_bits(monkeypatch):
    g = torch.Generator().manual_seed(8)
    w = [(torch.randn(2 * I_, H_, generator=g) * 0.1, torch.randn(H_, I_, generator=g) * 0.1) for _ in range(2)]

    def mlps(ops, quant: str | None = "int4", bias: bool = False) -> list[GatedMLP]:
        return [GatedMLP(Linear(a, torch.zeros(2 * I_) if bias else None, quant), Linear(b, None, quant), "silu",
                         ops) for a, b in w]
    fused = FusedCpuOps(1e-6)
    assert packed_experts(mlps(fused), "silu", fused) is not None
    assert packed_experts(mlps(TorchOps(1e-6)), "silu", TorchOps(1e-6)) is None     # torch's SiLU bits
    assert packed_experts(mlps(fused, None), "silu", fused) is None                 # dense experts
    assert packed_experts(mlps(fused, bias=True), "silu", fused) is None
    monkeypatch.setenv("CHATSERVE_MOE_KERNEL", "0")
    assert packed_experts(mlps(fused), "silu", fused) is None
