"""The fused CPU elementwise ops (kernels/cpu_ops.c) against the torch code they replace, op by op
and through a whole tiny model (fused forward vs the torch forward)."""
from __future__ import annotations

import pytest
import torch

from chatserve_kernels import cpu_build, cpu_ops

needs_lib = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason=str(cpu_build.status("cpu_ops")))
DTYPES = [torch.float32, torch.bfloat16]


def torch_norm(h, add, w, eps):
    if add is not None:
        h = h + add
    xf = h.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return h, w * xf.to(h.dtype)


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 576), (300, 128)])
@pytest.mark.parametrize("with_add", [True, False])
def test_add_rms_norm(dt, T, H, with_add):
    g = torch.Generator().manual_seed(T * H)
    h = torch.randn(T, H, generator=g).to(dt)
    add = torch.randn(T, H, generator=g).to(dt) if with_add else None
    w = (torch.rand(H, generator=g) + 0.5).to(dt)
    want_h, want = torch_norm(h, add, w, 1e-5)
    got = cpu_ops.add_rms_norm(h, add, w, 1e-5)          # h is updated in place
    assert torch.equal(h, want_h)
    if dt == torch.bfloat16:
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
        assert (got != want).float().mean() < 0.01      # the same bits but for rare 1-ulp roundings
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T,heads,D", [(1, 12, 64), (7, 4, 128), (40, 3, 32)])
def test_rope_in_place(dt, T, heads, D):
    g = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, heads + 2, D, generator=g).to(dt)
    ang = torch.rand(64, D // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dt)
    pos = torch.randint(0, 64, (T,), generator=g)
    x = qkv[:, :heads]
    want = torch.addcmul(x * cos[pos].unsqueeze(1), x.roll(D // 2, -1), sin[pos].unsqueeze(1))
    untouched = qkv[:, heads:].clone()
    cpu_ops.rope_(qkv[:, :heads], cos, sin, pos)
    torch.testing.assert_close(qkv[:, :heads], want, rtol=0, atol=1e-6 if dt == torch.float32 else 0)
    assert torch.equal(qkv[:, heads:], untouched)


@needs_lib
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_fused_forward_matches_the_torch_forward(tmp_path, dt):
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
    from chatserve.core.request import SamplingParams
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.runtime.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=3)
    runs = []
    for fused in (True, False):
        r = ModelRunner.from_config(offline_config(path, dtype=dt, num_blocks=16, block_size=4, num_threads=1))
        r.model.fused = fused
        p = SamplingParams(temperature=0.0, logprobs=5)
        prompt = list(range(3, 14))
        out = r.execute(SchedulerOutput(1, [ScheduledSeq("a", prompt, 0, [0, 1, 2], True, p, prompt)]))
        toks = [out.sampled["a"]]
        for i in range(4):
            out = r.execute(SchedulerOutput(2 + i, [ScheduledSeq("a", [toks[-1]], 11 + i, [0, 1, 2, 3, 4], True, p, prompt)]))
            toks.append(out.sampled["a"])
        runs.append(toks)
    assert runs[0] == runs[1]


@needs_lib
def test_fused_forward_rejects_positions_beyond_the_rope_tables(tmp_path):
    from chatserve.runtime.models.llama import LlamaModel
    from chatserve.runtime.tiny import make_tiny_model
    from chatserve.runtime.weights import load_weights
    from chatserve_kernels import AttentionMetadata

    w = load_weights(make_tiny_model(tmp_path / "m"), torch.float32, progress=False)
    model = LlamaModel(w.config, w.tensors, torch.float32, max_model_len=32)
    caches = [(torch.zeros(4, 16, w.config.num_kv_heads, w.config.head_dim),) * 2
              for _ in range(w.config.num_layers)]
    meta = AttentionMetadata.build([1], [40], [[0, 1, 2]], 16)
    with pytest.raises(IndexError):
        model.forward(torch.tensor([5]), torch.tensor([39]), caches, meta)


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
def test_silu_mul_matches_torch(dt):
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(3, 2 * 96, generator=g) * 4).to(dt)
    out = torch.empty(3, 96, dtype=dt)
    cpu_ops.library().chatserve_silu_mul(cpu_ops._DTYPES[dt], gu.data_ptr(), out.data_ptr(), 3, 96, 1)
    gate, up = gu.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up
    tol = 1e-6 if dt == torch.float32 else 1e-2
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)


def _silu_inputs(rows: int, I: int, dt: torch.dtype) -> torch.Tensor:
    """gu [rows, 2I]: gates from N(0, 4²) plus a sweep over [-120, 120] and ±inf, NaN, ±0 (row 0), ups N(0, 1)."""
    g = torch.Generator().manual_seed(rows * I)
    gate = torch.randn(rows, I, generator=g) * 4
    gate[0] = torch.linspace(-120, 120, I)
    gate[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    return torch.cat([gate, torch.randn(rows, I, generator=g)], 1).to(dt).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("I", [1536, 77])             # 77: a masked tail after 4 full vectors
def test_silu_mul_vector_path_matches_torch(dt, I):
    """The vectorized silu·up (AVX-512: exp16 + exact bf16 rounding) against F.silu(g) * u: bf16 results
    identical to torch's on every element (both round silu to bf16, then the product), fp32 within
    2 ulp of it (two ~1-ulp exps)."""
    gu = _silu_inputs(33, I, dt)
    out = cpu_ops.silu_mul(gu)
    gate, up = gu.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up
    if dt == torch.bfloat16:
        assert _same(out, ref)
    else:
        fin = ref.isfinite() & (ref.abs() > 1e-30)
        assert _same(out[~fin & ~ref.isfinite()], ref[~fin & ~ref.isfinite()])
        assert torch.allclose(out[fin], ref[fin], rtol=3e-7, atol=0)


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
def test_silu_mul_row_bits_do_not_depend_on_the_row_count(dt):
    """Batch invariance: a row alone, among 3 or among 96 rows (two threads from 22 rows of 1,536 up)
    gets the same bits."""
    gu = _silu_inputs(96, 1536, dt)
    many = cpu_ops.silu_mul(gu)
    for lo, hi in [(0, 1), (5, 6), (40, 43)]:
        assert _same(cpu_ops.silu_mul(gu[lo:hi].contiguous()), many[lo:hi])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _same(cpu_ops.silu_mul(gu), many)
    finally:
        torch.set_num_threads(n)


@needs_lib
def test_store_rows_writes_each_slot_and_skips_minus_one():
    k_cache, v_cache = torch.zeros(4, 2, 3, 8), torch.zeros(4, 2, 3, 8)      # [blocks, block_size, hkv, d]
    src = torch.arange(3 * 64, dtype=torch.float32).reshape(3, 64)        # rows: [k (24) | v (24) | pad]
    slots = torch.tensor([5, -1, 0])
    cpu_ops.library().chatserve_store_rows(src.data_ptr(), src.data_ptr() + 24 * 4, 64 * 4, k_cache.data_ptr(),
                                        v_cache.data_ptr(), slots.data_ptr(), 3, 24 * 4)
    flat_k, flat_v = k_cache.view(8, 24), v_cache.view(8, 24)
    assert torch.equal(flat_k[5], src[0, :24]) and torch.equal(flat_v[5], src[0, 24:48])
    assert torch.equal(flat_k[0], src[2, :24]) and torch.equal(flat_v[0], src[2, 24:48])
    assert int((flat_k != 0).any(-1).sum()) == 2                          # the -1 row wrote nothing


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
def test_store_rows_from_a_fused_qkv_matches_the_torch_store(dt):
    """cpu_ops.store_rows (the cpu-c backend's store) on K/V views of a fused qkv [T, hq + 2 hkv, d] writes
    the bytes store_kv_torch writes, skipping -1 slots; tensors it does not take are declined untouched."""
    from chatserve_kernels.kv_store import store_kv_torch

    g = torch.Generator().manual_seed(3)
    T, hq, hkv, d = 7, 9, 3, 64
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=g).to(dt)
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    slots = torch.tensor([5, 6, -1, 17, 40, 0, 63])
    caches = [torch.zeros(4, 16, hkv, d, dtype=dt) for _ in range(4)]
    assert cpu_ops.store_rows(k, v, caches[0], caches[1], slots)
    store_kv_torch(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    other = torch.float32 if dt == torch.bfloat16 else torch.bfloat16
    assert not cpu_ops.store_rows(k.to(other), v.to(other), caches[0], caches[1], slots)
    assert not cpu_ops.store_rows(k.transpose(1, 2), v.transpose(1, 2), caches[0], caches[1], slots)
    assert not cpu_ops.store_rows(k, v, caches[0], caches[1], slots.int())


@needs_lib
@pytest.mark.parametrize("dt", DTYPES)
def test_silu_mul_avx2_level_gives_the_native_bits(dt):
    """Every CPU with AVX2 + FMA builds SiLU·up at the AVX2 level too (exp8: exp16's arithmetic on 8 lanes):
    its bits equal the native build's (AVX-512 where the CPU has it, else the same AVX2 code), torch's for
    bf16, and a row's bits do not depend on the row count; a full-width and a 77-column (tail) case."""
    lib = cpu_ops.avx2_library()
    if not {"avx2", "fma"} <= cpu_build.cpu_flags():
        assert lib is None
        return
    assert lib is not None and lib.chatserve_ops_level() == 2
    for I in (1536, 77):
        gu = _silu_inputs(33, I, dt)
        out = torch.empty(33, I, dtype=dt)
        lib.chatserve_silu_mul(cpu_ops._DTYPES[dt], gu.data_ptr(), out.data_ptr(), 33, I, 1)
        assert _same(out, cpu_ops.silu_mul(gu))
        if dt == torch.bfloat16:
            gate, up = gu.chunk(2, -1)
            assert _same(out, torch.nn.functional.silu(gate) * up)
        one = torch.empty(1, I, dtype=dt)
        lib.chatserve_silu_mul(cpu_ops._DTYPES[dt], gu[7:8].contiguous().data_ptr(), one.data_ptr(), 1, I, 1)
        assert _same(one, out[7:8])
