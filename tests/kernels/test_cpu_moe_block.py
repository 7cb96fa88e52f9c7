"""cpu_moe_block (one C call per MoE layer for decode rows, on experts kept in their GGUF block format) against
the expert loop it replaces (models/moe.py over linear_backends.CpuBlockLinear, cpu_blockq8's per-lane kernel,
cpu_ops' SiLU·mul): the same bits at every row count, format mix, dtype and level; a row's result independent
of the rows beside it and of the thread count; near its plain-torch twin (block_q8's matmul); and the MoE
layer's dispatch (generated rows through the call, prompt rows through the loop)."""
from __future__ import annotations

import pytest
import torch
from test_cpu_blockmm import make_weight

from chatserve.runtime.models import linear_backends as lb
from chatserve.runtime.models.layers import ALL_GENERATED, ALL_PROMPT, FusedCpuOps, GatedMLP, Linear, RowSplit, TorchOps
from chatserve.runtime.models.moe import MoE, block_experts, packed_experts
from chatserve_kernels import cpu_blockmm, cpu_moe_block

BACKENDS = {"avx512": lb.CpuAvx512BlockLinear, "avx2": lb.CpuAvx2BlockLinear}
LEVELS = [isa for isa in BACKENDS if cpu_moe_block.available(isa)]
pytestmark = pytest.mark.skipif(not LEVELS, reason="no cpu_blockq8 level or cpu_ops on this CPU")
H_, I_, E_ = 256, 256, 6
# (gate and up format, down format): a Q4_0 file, a Q4_K_M-like mix, two formats with and without a min
MIXES = [("Q4_0", "Q4_0"), ("Q4_K", "Q6_K"), ("Q8_0", "Q5_1")]


def make_moe(isa: str, mix: tuple[str, str], dtype: torch.dtype = torch.float32, top_k: int = 3,
             seed: int = 0, shared: bool = False, tile: bool = False) -> MoE:
    """A MoE layer on block-format experts (gate and up two bands, as a GGUF's stacked tensors give them) with
    the C call's table (moe.packed a BlockExperts) on FusedCpuOps, as an in-place GGUF load builds it; tile: the
    experts' tiled decode copies (CHATSERVE_MOE_TILED), which the table then points at."""
    g = torch.Generator().manual_seed(seed)
    ops, cls = FusedCpuOps(1e-6), BACKENDS[isa]

    def mlp(s: int) -> GatedMLP:
        gate, up = make_weight(mix[0], I_, H_, seed=3 * s), make_weight(mix[0], I_, H_, seed=3 * s + 1)
        down = make_weight(mix[1], H_, I_, seed=3 * s + 2)
        return GatedMLP(cls(lb.BlockMatrix([gate, up]), None, tile), cls(lb.BlockMatrix([down]), None, tile), "silu",
                        ops)
    experts = [mlp(seed * 100 + e) for e in range(E_)]
    sh, gate = (mlp(seed * 100 + 99), Linear((torch.randn(1, H_, generator=g) * 0.1).to(dtype))) if shared \
        else (None, None)
    router = Linear((torch.randn(E_, H_, generator=g) * 0.1).to(dtype))
    moe = MoE(router, experts, top_k, True, sh, gate, block_experts(experts, "silu", ops))
    assert isinstance(moe.packed, cpu_moe_block.BlockExperts) and moe.packed.tiled == tile
    return moe


def loop(moe: MoE, x: torch.Tensor, rows: RowSplit | None = ALL_GENERATED) -> torch.Tensor:
    """The same layer through its expert loop (the oracle the C call must match bit for bit)."""
    packed, moe.packed = moe.packed, None
    try:
        return moe(x, rows)
    finally:
        moe.packed = packed


def table(moe: MoE) -> cpu_moe_block.BlockExperts:
    assert isinstance(moe.packed, cpu_moe_block.BlockExperts)
    return moe.packed


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("tile", [False, True])
def test_one_call_gives_the_expert_loops_bits(isa, mix, dtype, top_k, tile):
    """tile: gate_up (and down where its format has a tiled layout; Q5_1 not) on the tiled copies, the loop's
    CpuBlockLinear on the same copies."""
    moe = make_moe(isa, mix, dtype, top_k, tile=tile)
    g = torch.Generator().manual_seed(1)
    for T in (1, 2, 5, 9, 16):                  # row tiles of 1/2/4/8 inside an expert's group, and mixes
        x = torch.randn(T, H_, generator=g).to(dtype)
        w, idx = moe.route(x)
        got = cpu_moe_block.moe(x, idx, w, table(moe))
        assert got.dtype == dtype and got.shape == (T, H_)
        torch.testing.assert_close(got, loop(moe, x), rtol=0, atol=0)
        torch.testing.assert_close(moe(x, ALL_GENERATED), got, rtol=0, atol=0)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("tile", [False, True])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(isa, tile, monkeypatch):
    """Alone, in a batch, in another order, beside copies of itself (its experts then shared by several rows),
    with one thread or three, the threads taking whole band calls or (every call above the one-thread size)
    splitting each call's columns: the same bits (the per-lane kernel and the tiled copies alike)."""
    moe = make_moe(isa, ("Q4_K", "Q6_K"), torch.bfloat16, top_k=4, tile=tile)
    x = torch.randn(12, H_, generator=torch.Generator().manual_seed(2)).bfloat16()
    w, idx = moe.route(x)
    batch = cpu_moe_block.moe(x, idx, w, table(moe))
    for t in range(12):
        alone = cpu_moe_block.moe(x[t:t + 1], idx[t:t + 1], w[t:t + 1], table(moe))
        torch.testing.assert_close(alone[0], batch[t], rtol=0, atol=0)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(cpu_moe_block.moe(x[perm], idx[perm], w[perm], table(moe)), batch[perm],
                               rtol=0, atol=0)
    rep = torch.tensor([5, 5, 5, 0, 5])                                 # row 5 four times: its experts shared
    torch.testing.assert_close(cpu_moe_block.moe(x[rep], idx[rep], w[rep], table(moe)), batch[rep], rtol=0, atol=0)
    for threads in (1, 3):
        torch.testing.assert_close(cpu_moe_block.moe(x, idx, w, table(moe), threads), batch, rtol=0, atol=0)
    monkeypatch.setattr(cpu_blockmm, "ONE_THREAD_MACS", 0)
    for threads in (2, 3):
        torch.testing.assert_close(cpu_moe_block.moe(x, idx, w, table(moe), threads), batch, rtol=0, atol=0)


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("tile", [False, True])
def test_near_the_plain_torch_twin(mix, isa, tile):
    """Against block_q8's matmul (the block kernel's twin, float64 joins; for tiled bands matmul_tiled, the
    tiled kernel's own order) and torch's SiLU·up and combine: within 1e-5 of the output's largest value."""
    moe = make_moe(isa, mix, torch.float32, top_k=3, tile=tile)
    x = torch.randn(4, H_, generator=torch.Generator().manual_seed(5))
    w, idx = moe.route(x)
    got = cpu_moe_block.moe(x, idx, w, table(moe))
    ref = cpu_moe_block.reference(x, idx, w, table(moe))
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), float((got - ref).abs().max())


def test_a_mixed_step_sends_generated_rows_through_the_call_and_prompt_rows_through_the_loop():
    moe = make_moe(LEVELS[0], ("Q4_0", "Q4_0"), torch.bfloat16, top_k=2, shared=True)
    x = torch.randn(6, H_, generator=torch.Generator().manual_seed(6)).bfloat16()
    rows = RowSplit.build([True, False, True, True, False, False], x.device)
    got = moe(x, rows)
    torch.testing.assert_close(got, loop(moe, x, rows), rtol=0, atol=0)
    gen, prompt = rows.gen, rows.prompt
    assert gen is not None and prompt is not None
    torch.testing.assert_close(got[gen], moe(x[gen], ALL_GENERATED), rtol=0, atol=0)
    torch.testing.assert_close(got[prompt], loop(moe, x[prompt], ALL_PROMPT), rtol=0, atol=0)


def test_rows_none_takes_the_call_up_to_small_m_rows():
    moe = make_moe(LEVELS[0], ("Q4_0", "Q4_0"), torch.bfloat16)
    x = torch.randn(moe.small_m, H_, generator=torch.Generator().manual_seed(7)).bfloat16()
    torch.testing.assert_close(moe(x, None), loop(moe, x, None), rtol=0, atol=0)


def test_no_table_where_the_call_would_not_give_the_loops_bits(monkeypatch):
    cls = BACKENDS[LEVELS[0]]

    def mlps(ops, fmt: str = "Q4_0", tile: bool = False, bias: bool = False) -> list[GatedMLP]:
        def lin(n: int, k: int, s: int):
            return cls(lb.BlockMatrix([make_weight(fmt, n, k, seed=s)]), torch.zeros(n) if bias else None, tile)
        return [GatedMLP(lin(2 * I_, H_, 2 * e), lin(H_, I_, 2 * e + 1), "silu", ops) for e in range(2)]
    fused = FusedCpuOps(1e-6)
    assert block_experts(mlps(fused), "silu", fused) is not None
    assert packed_experts(mlps(fused), "silu", fused) is None                      # not cpu_qmatmul weights
    assert block_experts(mlps(TorchOps(1e-6)), "silu", TorchOps(1e-6)) is None     # torch's SiLU bits
    assert block_experts(mlps(fused, "F16"), "silu", fused) is None                # no codes: the float path
    assert block_experts(mlps(fused, bias=True), "silu", fused) is None
    tiled = block_experts(mlps(fused, tile=True), "silu", fused)                   # the tiled copies' table
    assert tiled is not None and tiled.tiled and int(tiled.gu_table[0, 0, 2]) == 0
    monkeypatch.setenv("CHATSERVE_MOE_KERNEL", "0")
    assert block_experts(mlps(fused), "silu", fused) is None
