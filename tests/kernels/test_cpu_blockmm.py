"""cpu_blockmm (GGUF block formats in place, AVX2 and AVX-512 levels) and block_formats' torch twin:
the twin's dequantization is bit-equal to gguf-py's on the same bytes, the kernel's is bit-equal to the
twin's, the matmul matches the twin tightly and the dense dequantized matmul loosely for every format and
level (ragged N, K at block boundaries, K over several of the AVX2 level's KC spans, M off its 6-row tile),
and every output row is batch invariant: the same bits for every M, whatever rows share the call, alone or
among others, with 1 or 2 threads, fp32 or bf16 x and y (issue 28)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from chatserve_kernels import block_formats as bf
from chatserve_kernels import cpu_blockmm

# the levels this CPU runs (an AVX-512 CPU runs both): not a skip, a parametrization over what exists
LEVELS = [isa for isa in cpu_blockmm.LEVELS if cpu_blockmm.supported(isa)]
# and the paths: the AVX-512 level with its AMX-BF16 tiles on (bf16 x; where the CPU has them) and off
PATHS = [(isa, False) for isa in LEVELS] + [("avx512", True)] * ("avx512" in LEVELS and cpu_blockmm.supported("amx"))
PATH_IDS = [f"{isa}{'-amx' if on else ''}" for isa, on in PATHS]
FORMATS = list(bf.FORMATS)
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")   # gguf-py quantizes these
BATCH_MS = (1, 2, 3, 5, 6, 7, 8, 15, 16, 17, 31, 64, 67, 100, 121, 257, 300)


def test_this_cpu_has_a_level():
    assert LEVELS, "cpu_blockmm needs AVX2+FMA+F16C; the serving path falls back to the torch twin"
    assert all(cpu_blockmm.available(isa) for isa in LEVELS)
    # the AMX path is on by default where the CPU has the tiles (a build or arch_prctl failure would be a bug)
    assert cpu_blockmm.amx("avx512") == ("avx512" in LEVELS and cpu_blockmm.supported("amx"))
    assert not cpu_blockmm.amx("avx2")


@pytest.fixture
def path(request):
    """(isa, amx) of PATHS with the AVX-512 level's AMX switch set for the test and put back after it."""
    isa, on = request.param
    was = cpu_blockmm.amx("avx512") if "avx512" in LEVELS else False
    if isa == "avx512":
        assert cpu_blockmm.use_amx(isa, on) == on
    yield isa, on
    if "avx512" in LEVELS:
        cpu_blockmm.use_amx("avx512", was)


def oracle_w(dense: torch.Tensor, isa: str, x_dtype: torch.dtype) -> torch.Tensor:
    """The dense W a path multiplies: rounded to bf16 on the AMX path (bf16 x), else as dequantized."""
    return dense.bfloat16().float() if cpu_blockmm.rounds_w(isa, x_dtype) else dense


def make_weight(name: str, n: int, k: int, seed: int = 0, random_bytes: bool = False) -> bf.BlockWeight:
    """W [n, k] of format `name`: gguf-py's quantization of Gaussian values where gguf-py quantizes the
    format, else random blocks with finite fp16 scales (every code pattern, sane magnitudes)."""
    if name in QUANTIZABLE and not random_bytes:
        a = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = np.ascontiguousarray(gguf_quantize(a, GGMLQuantizationType[name])).view(np.uint8)
        return bf.BlockWeight(torch.from_numpy(raw.reshape(n, -1)), bf.FORMATS[name], n, k)
    return bf.random_weight(name, n, k, seed)


def gguf_reference(w: bf.BlockWeight) -> torch.Tensor:
    raw = w.data.numpy()
    return torch.from_numpy(np.ascontiguousarray(
        gguf_dequantize(raw, GGMLQuantizationType[w.fmt.name]).reshape(w.n, w.k).astype(np.float32)))


def shapes(name: str) -> list[tuple[int, int]]:
    b = bf.FORMATS[name].block
    return [(1, b), (5, 2 * b), (37, 3 * b)] if b > 1 else [(1, 1), (7, 15), (37, 17), (16, 33)]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("random_bytes", [False, True])
def test_twin_dequantizes_bit_equal_to_gguf_py(name, random_bytes):
    for n, k in shapes(name):
        w = make_weight(name, n, k, seed=n + k, random_bytes=random_bytes)
        got = bf.dequantize(w)
        want = gguf_reference(w)
        assert got.abs().sum() > 0
        assert torch.equal(got, want), (name, n, k)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_dequantizes_bit_equal_to_the_twin(isa, name):
    for n, k in shapes(name):
        w = make_weight(name, n, k, seed=3 * n + k, random_bytes=True)
        assert torch.equal(cpu_blockmm.dequantize(w, isa), bf.dequantize(w)), (name, n, k)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS, indirect=True)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_the_twin_and_the_dense_matmul(path, name, dtype):
    isa, _ = path
    g = torch.Generator().manual_seed(7)
    for n, k in shapes(name):
        w = make_weight(name, n, k, seed=n * k)
        dense = oracle_w(gguf_reference(w), isa, dtype)
        for m in (1, 4, 6):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = cpu_blockmm.matmul(x, w, isa, out_dtype=torch.float32)
            twin = bf.matmul_torch(x, w, torch.float32, w_bf16=cpu_blockmm.rounds_w(isa, dtype))
            assert y.shape == (m, n) and y.abs().sum() > 0
            # the twin: float32 dots in another order; the bound is a few ulps of Σ|x||w|
            scale = x.float().abs() @ dense.abs().t()
            assert bool(((y - twin).abs() <= scale * 1e-5 + 1e-30).all()), (name, n, k, m)
            # the dense oracle, as transformers would run it (sanity: the right layout and scales)
            exact = (x.double() @ dense.double().t()).float()
            assert bool(((y - exact).abs() <= scale * 1e-4 + 1e-6).all()), (name, n, k, m)
            if dtype == torch.bfloat16:     # bf16 out is the float32 result rounded once
                assert torch.equal(cpu_blockmm.matmul(x, w, isa), y.to(torch.bfloat16))


def long_shapes(name: str) -> list[tuple[int, int]]:
    """N off the 16-column panel and K over several 256-wide spans, with a short last span (a tail of one
    block, or for F32/F16/BF16 a tail off the 8-wide transpose)."""
    b = bf.FORMATS[name].block
    if b == 256:
        return [(37, 512), (19, 1280)]
    return [(37, 9 * b), (130, 17 * b)] if b > 1 else [(37, 300), (19, 517)]


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS, indirect=True)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_over_long_k_and_ragged_tiles_matches_the_twin(path, name, dtype):
    """M = 1, 5, 16, 64, 300 (and off the tiles: 7, 13, 67) against the twin, per format and path."""
    isa, _ = path
    g = torch.Generator().manual_seed(13)
    for n, k in long_shapes(name):
        w = make_weight(name, n, k, seed=n + k)
        dense = oracle_w(gguf_reference(w), isa, dtype)
        for m in (1, 5, 7, 13, 16, 64, 67, 300):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = cpu_blockmm.matmul(x, w, isa, out_dtype=torch.float32)
            twin = bf.matmul_torch(x, w, torch.float32, w_bf16=cpu_blockmm.rounds_w(isa, dtype))
            assert y.shape == (m, n) and y.abs().sum() > 0
            scale = x.float().abs() @ dense.abs().t()
            assert bool(((y - twin).abs() <= scale * 1e-5 + 1e-30).all()), (name, n, k, m)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS, indirect=True)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_rows_are_batch_invariant(path, name, x_dtype, monkeypatch):
    """Row i's bits do not depend on M, on the rows beside it, or on 1 or 2 threads (K over two spans, N
    over several panels and, with 2 threads, several column groups; on the AMX path over several tile
    pairs, with x tiles of 1-16 rows and odd counts of them)."""
    isa, _ = path
    monkeypatch.setattr(cpu_blockmm, "ONE_THREAD_MACS", 0)     # small calls too take the threads asked for
    n, k = 53, 2 * bf.FORMATS[name].block if bf.FORMATS[name].block == 256 else 320
    if bf.FORMATS[name].block == 1:
        n, k = 75, 333                  # K off the tile's 32 pairs and the AVX2 transpose's 8
    w = make_weight(name, n, k, seed=11)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(max(BATCH_MS), k, generator=g).to(x_dtype)
    full = cpu_blockmm.matmul(x, w, isa, threads=1)
    assert full.float().abs().sum() > 0
    full32 = cpu_blockmm.matmul(x, w, isa, threads=1, out_dtype=torch.float32)
    if x_dtype == torch.bfloat16:       # bf16 y is the float32 y rounded once
        assert torch.equal(full, full32.bfloat16())
    for i in (0, 4, 66, 299):           # each row alone
        assert torch.equal(cpu_blockmm.matmul(x[i:i + 1], w, isa, threads=1, out_dtype=torch.float32), full32[i:i + 1])
    for threads in (1, 2):
        for m in BATCH_MS:
            got = cpu_blockmm.matmul(x[:m], w, isa, threads=threads)
            assert torch.equal(got, full[:m]), (name, threads, m)
            # the same rows after other rows in the call
            mixed = torch.cat([torch.randn(3, k, generator=g).to(x_dtype), x[:m]])
            assert torch.equal(cpu_blockmm.matmul(mixed, w, isa, threads=threads)[3:], full[:m])


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_a_row_length_off_the_block_is_refused(name):
    with pytest.raises(ValueError, match="multiple of"):
        bf.BlockWeight(torch.zeros(2, 18, dtype=torch.uint8), bf.FORMATS[name], 2, 31)
    with pytest.raises(ValueError, match="needs uint8"):
        bf.BlockWeight(torch.zeros(2, 17, dtype=torch.uint8), bf.FORMATS[name], 2, 256)


def test_bench_blockmm_times_a_before_source_beside_torch_fp32():
    from chatserve.bench import blockmm
    args = blockmm.build_parser().parse_args(["--formats", "Q4_1", "--shapes", "48x64", "--rows", "1,7", "--repeats",
                                              "1", "--q8-isas", "", "--x-dtype", "float32", "--before",
                                              str(cpu_blockmm.SOURCE), "--json"])
    rows = blockmm.run(args)
    assert [r["m"] for r in rows] == [1, 7]
    for r in rows:
        want = {"torch-fp32"} | {f"Q4_1/{isa}{tag}" for isa in LEVELS for tag in ("", "-before")}
        assert want <= set(r["ms"]) and all(v > 0 for v in r["ms"].values())


# ---- a tiled source: prompt rows read cpu_blockq8's row-interleaved copy (the decode rows') instead of the file ----
TILED = list(cpu_blockmm.TILED_FORMATS)


@pytest.mark.parametrize("name", TILED)
def test_a_tiled_copy_dequantizes_to_the_files_values(name):
    """The twin (block_q8.dequantize_tiled) and every level's kernel read a tiled copy back to the file's
    values bit for bit, the padding rows of the last tile dropped."""
    from chatserve_kernels import block_q8, cpu_blockq8
    for n, k in [(1, 256), (16, 256), (37, 512), (50, 1280)]:
        w = make_weight(name, n, k, seed=n + k, random_bytes=True)
        ref = gguf_reference(w)
        t = torch.from_numpy(block_q8.tile(w).numpy().reshape(-1))
        tw = cpu_blockq8.TiledWeight(t, w.fmt, n, k)
        assert torch.equal(block_q8.dequantize_tiled(t, name, n, k), ref)
        for isa in LEVELS:
            assert torch.equal(cpu_blockmm.dequantize_tiled(tw, isa), ref), (name, isa, n, k)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS, indirect=True)
@pytest.mark.parametrize("name", TILED)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_on_a_tiled_copy_equal_the_files_bit_for_bit(path, name, x_dtype):
    """matmul_tiled on the tiled copy gives matmul on the file's blocks exactly, at every M (each level and
    path: AVX2, AVX-512, AMX), in float32 and bfloat16 out; a misaligned copy is refused."""
    from chatserve_kernels import cpu_blockq8
    isa, _ = path
    g = torch.Generator().manual_seed(11)
    for n, k in [(37, 512), (130, 1280)]:
        w = make_weight(name, n, k, seed=n * k, random_bytes=True)
        tw = cpu_blockq8.tile(w, "avx2")
        for m in (1, 5, 6, 17, 130):
            x = torch.randn(m, k, generator=g).to(x_dtype)
            for out_dtype in (torch.float32, torch.bfloat16):
                want = cpu_blockmm.matmul(x, w, isa, out_dtype=out_dtype)
                assert torch.equal(cpu_blockmm.matmul_tiled(x, tw, isa, out_dtype=out_dtype), want), (n, k, m)
    odd = cpu_blockq8.TiledWeight(torch.empty(tw.data.numel() + 8, dtype=torch.uint8)[8:], tw.fmt, tw.n, tw.k)
    with pytest.raises(AssertionError):
        cpu_blockmm.matmul_tiled(x, odd, isa)
