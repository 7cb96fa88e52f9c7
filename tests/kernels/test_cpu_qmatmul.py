"""cpu_qmatmul (AVX-512 VNNI, or AVX2 with AVX-VNNI or maddubs) against its torch twin: packed 4/8-bit weights
times fp32/bf16 rows, every row-block path (1, 2, 4 rows and their mixes), a row count that is not a tile
multiple; exact integer dots at the extreme codes; the same bits at every level this CPU can run."""
from __future__ import annotations

import pytest
import torch

from chatserve_kernels import cpu_build
from chatserve_kernels import cpu_qmatmul as Q

pytestmark = pytest.mark.skipif(not Q.available(), reason=str(cpu_build.status("cpu_qmatmul")))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(37, 64), (96, 160), (16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_dequantized_matmul(bits, n, k, dtype):
    g = torch.Generator().manual_seed(n * k + bits)
    codes, scale, lo = Q.quantize(torch.randn(n, k, generator=g), bits)
    assert int(codes.min()) >= 0 and int(codes.max()) == (1 << bits) - 1
    packed = Q.pack(codes, scale, lo, bits)
    w = Q.dequantize(codes, scale, lo)
    for m in (1, 2, 3, 4, 7, 9):
        x = torch.randn(m, k, generator=g).to(dtype)
        y = Q.matmul(x, packed)
        assert y.shape == (m, n) and y.dtype == dtype
        ref = x.float() @ w.t()
        # the only approximation is x's codes per group of 32 (int8 at worst: ≤ 0.5/127 of the group's max each),
        # which multiply code · scale (the low times the exact group sum of x is exact; a scale may be negative)
        step = (x.float().abs().reshape(m, -1, 32).amax(-1) / 254).repeat_interleave(32, -1)
        bound = step @ Q.dequantize(codes, scale.abs(), torch.zeros_like(lo)).t()
        tol = bound + (ref.abs() * 2 ** -7 if dtype == torch.bfloat16 else 1e-4)
        assert bool(((y.float() - ref).abs() <= tol + 1e-5).all()), (m, float((y.float() - ref).abs().max()))


def test_quantize_round_trips_a_grouped_4bit_matrix():
    """Codes that came from groups of 32 with an fp16 min and step (GGUF Q4_1) are rebuilt exactly."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), generator=g)
    scale = (torch.rand(32, 2, generator=g) + 0.1).half().float()       # GGUF keeps both in fp16
    lo = torch.randn(32, 2, generator=g).half().float()
    codes[:, 0], codes[:, 1], codes[:, 32], codes[:, 33] = 0, 15, 0, 15    # each group spans 0..15
    w = Q.dequantize(codes, scale, lo)
    c2, s2, l2 = Q.quantize(w, 4)
    assert torch.equal(c2, codes.to(torch.int32))
    assert torch.allclose(Q.dequantize(c2, s2, l2), w, atol=1e-5)


def test_linear_float_out_keeps_the_kernels_float32_result():
    """The LM head's logits: bf16 rows in, float32 out, not rounded through bf16 (rounded logits tie): the rows
    enter the kernel as float32 (so as 15-bit codes) and its float32 result is returned as it is."""
    from chatserve.runtime.models.layers import Linear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 128, generator=g) * 0.05).bfloat16()
    x = torch.randn(3, 128, generator=g).bfloat16()
    head = Linear(w, None, "int8")
    y = head.float_out(x)                                   # [3, 512]
    assert y.dtype == torch.float32 and head.qw is not None
    assert (y.bfloat16().float() != y).any()                # not on the bf16 grid
    torch.testing.assert_close(y, head(x.float()), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_and_thread_invariant(bits, dtype):
    """A row's result has the same bits at every row count (1 to 21: every row-block mix, and more than 8
    rows, where the tiles run in L2-sized chunks over all the row blocks) and thread count (batch
    invariance, issue 28). K = 2048 makes a tile 20 KiB, so 24 tiles span several chunks."""
    g = torch.Generator().manual_seed(bits)
    n, k = 24 * 16 - 5, 2048
    packed = Q.pack(*Q.quantize(torch.randn(n, k, generator=g) * 0.05, bits), bits)
    x = torch.randn(21, k, generator=g).to(dtype)
    alone = torch.cat([Q.matmul(x[i:i + 1], packed) for i in range(21)])
    threads = torch.get_num_threads()
    try:
        for nt in sorted({1, threads}):
            torch.set_num_threads(nt)
            for m in (2, 5, 8, 9, 16, 21):
                torch.testing.assert_close(Q.matmul(x[:m], packed), alone[:m], rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits,k,dtype", [(4, 32, torch.float32), (8, 32, torch.float32), (8, 64, torch.bfloat16)])
def test_integer_dots_are_exact_at_the_extreme_codes(bits, k, dtype):
    """Codes at 0 and the top (15, 255) against x codes at ±the top (15-bit codes, 32639: 4-bit weights, and 8-bit
    ones under fp32 x; int8 codes, 127: 8-bit weights under bf16 x): with scale 1, low 0 and x already on its code
    grid the output is the exact integer dot rounded once to the output dtype, so a saturating pair sum
    (pmaddubsw on raw 8-bit codes: 2 · 255 · 127 > 32767) shows."""
    g = torch.Generator().manual_seed(bits)
    n, top = 40, (1 << bits) - 1
    xtop = 127 if bits == 8 and dtype == torch.bfloat16 else 32639
    codes = torch.randint(0, 2, (n, k), generator=g) * top
    codes[:, :8] = top                                       # the same codes on a pair: the largest pair sums
    packed = Q.pack(codes, torch.ones(n, k // 32), torch.zeros(n, k // 32), bits)
    x = (torch.randint(0, 2, (5, k), generator=g) * 2 - 1).float() * xtop
    x[0] = xtop
    x[1] = -xtop
    want = (x.double() @ codes.double().t()).float().to(dtype)   # one rounding of the exact integer
    torch.testing.assert_close(Q.matmul(x.to(dtype), packed), want, rtol=0, atol=0)


def test_every_level_this_cpu_runs_gives_the_same_bits():
    """The AVX-512 and AVX2 levels (with AVX-VNNI or maddubs dots) share the float epilogue per lane, so a
    row's bits do not depend on the level that ran it. Ragged N exercises both halves of an AVX2 tile."""
    levels = Q.supported_levels()
    assert "avx2-maddubs" in levels and Q.level() in levels
    g = torch.Generator().manual_seed(7)
    for bits in (4, 8):
        for n in (16 * 5 + 3, 16 * 5 + 11):
            packed = Q.pack(*Q.quantize(torch.randn(n, 256, generator=g) * 0.05, bits), bits)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(9, 256, generator=g).to(dtype)
                want = Q.matmul(x, packed)
                for name in levels:
                    lib = Q.level_library(name)
                    assert lib is not None, f"level {name} did not build (see the log)"
                    for m in (1, 2, 9):
                        torch.testing.assert_close(Q.matmul(x[:m], packed, lib), want[:m], rtol=0, atol=0)


def test_pack_cached_keeps_the_packed_weights_on_disk_and_gives_the_same_bytes(tmp_path, monkeypatch):
    """The first load quantizes and writes one file; the next maps it (no quantize call); a corrupt file is
    quantized again and replaced; CHATSERVE_WEIGHT_CACHE=0 writes nothing. Every time: pack(quantize(w))."""
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CHATSERVE_WEIGHT_CACHE", "1")
    monkeypatch.delenv("CHATSERVE_WEIGHT_CACHE_DIR")            # tests/conftest.py gives the suite its own
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g) * 0.05
    want = Q.pack(*Q.quantize(w, 4), 4)

    def same(p):
        assert (p.bits, p.n, p.k) == (4, 40, 96)
        assert torch.equal(p.codes, want.codes) and torch.equal(p.scale_lo, want.scale_lo)

    same(Q.pack_cached(w, 4))
    files = list((tmp_path / "qmatmul").iterdir())
    assert len(files) == 1 and files[0].suffix == ".pt"
    calls = []
    real = Q.quantize
    monkeypatch.setattr(Q, "quantize", lambda *a: calls.append(a) or real(*a))
    same(Q.pack_cached(w, 4))
    assert calls == []                                       # mapped, not quantized
    assert len(Q.pack_cached(w, 8).scale_lo) and len(list((tmp_path / "qmatmul").iterdir())) == 2   # bits: own file
    calls.clear()
    files[0].write_bytes(b"not a torch file")
    same(Q.pack_cached(w, 4))
    assert len(calls) == 1 and files[0].stat().st_size > 1000   # quantized again, replaced
    monkeypatch.setenv("CHATSERVE_WEIGHT_CACHE", "0")
    same(Q.pack_cached(w, 4))
    Q.pack_cached(w + 1.0, 4)
    assert len(list((tmp_path / "qmatmul").iterdir())) == 2   # nothing written with the cache off
