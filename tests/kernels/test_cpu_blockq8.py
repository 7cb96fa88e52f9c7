"""cpu_blockq8 (int8 activations against GGUF block codes; AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2 with maddubs)
and its torch twin block_q8: the twin's unpacking rebuilds block_formats' dequantization bit for bit; the
kernel's x codes, W codes and scales and integer dots equal the twin's exactly; the matmul matches the twin
within float rounding of its terms and the dense matmul within the int8 rounding of x, for every format and
level; and every output row is batch invariant (same bits at any M, beside any rows, on 1 or 2 threads)."""
from __future__ import annotations

import ctypes
import functools

import pytest
import torch
from test_cpu_blockmm import gguf_reference, make_weight

from chatserve_kernels import block_formats as bf
from chatserve_kernels import block_q8, cpu_blockmm, cpu_blockq8, cpu_build

# the levels this CPU runs: not a skip, a parametrization over what exists
LEVELS = [isa for isa in cpu_blockq8.LEVELS if cpu_blockq8.supported(isa)]
FORMATS = list(cpu_blockq8.FORMATS)
BATCH_MS = (1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 64)


def shapes(name: str) -> list[tuple[int, int]]:
    b = bf.FORMATS[name].block
    return [(1, b), (5, 2 * b), (37, 3 * b)] + ([(9, 5 * b)] if b == 32 else [])


def test_this_cpu_has_a_level():
    assert LEVELS, "cpu_blockq8 needs AVX2+FMA+F16C; the serving path falls back to cpu_blockmm's twin"
    assert all(cpu_blockq8.available(isa) for isa in LEVELS)
    assert sorted(block_q8.FORMATS) == sorted(FORMATS)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("random_bytes", [False, True])
def test_twin_unpacking_rebuilds_the_dequantization_bit_for_bit(name, random_bytes):
    for n, k in shapes(name):
        w = make_weight(name, n, k, seed=n + k, random_bytes=random_bytes)
        want = bf.dequantize(w)
        assert want.abs().sum() > 0
        assert torch.equal(block_q8.dequantize(w), want), (name, n, k)
        u, z, _, _ = block_q8.unpack(w)
        assert int((u.int() - z).abs().max()) <= 128          # the maddubs bound: |u − z| · 127 · 2 < 2^15


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_bits", [8, 15])
def test_x_codes_are_the_twins(isa, dtype, x_bits):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 160, generator=g) * torch.logspace(-3, 2, 160)).to(dtype)
    x[2, 32:64] = 0                                             # an all-zero block: scale 0, codes 0
    x[3, :32] = torch.arange(32) - 15.5                         # exact halves: round half to even
    q, d = cpu_blockq8.quantize(x, isa, x_bits)
    tq, td = block_q8.quantize(x, x_bits)
    assert q.abs().sum() > 0 and int(q.abs().max()) == block_q8.TOP[x_bits]
    assert torch.equal(q, tq) and torch.equal(d, td)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("x_bits", [8, 15])
def test_the_integer_part_is_exact(isa, name, x_bits):
    """W's codes, scales and mins, and the integer dots Σ (u − z)·q, equal the twin's exactly."""
    g = torch.Generator().manual_seed(2)
    for n, k in shapes(name):
        w = make_weight(name, n, k, seed=5 * n + k, random_bytes=True)
        u, z, ws, mn = block_q8.unpack(w)
        cu, cws, cmn = cpu_blockq8.unpack(w, isa)
        assert torch.equal(cu, u) and torch.equal(cws, ws) and torch.equal(cmn, mn), (name, n, k)
        top = int(block_q8.TOP[x_bits])
        q = torch.randint(-top, top + 1, (3, k), generator=g, dtype=torch.int16)
        q[0, :32] = top                                          # the extremes (maddubs' saturation bound)
        q[1, :32] = -top
        q[2, :8] = torch.tensor([127, 128, -127, -128, 255, -255, 254, 0])[:8] if x_bits == 15 else 0
        got = cpu_blockq8.dots(q, w, isa, x_bits)
        assert got.abs().sum() > 0
        assert torch.equal(got, block_q8.dots(q, w)), (name, n, k)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_bits", [8, 15])
def test_matmul_matches_the_twin_and_the_dense_matmul(isa, name, dtype, x_bits):
    g = torch.Generator().manual_seed(7)
    for n, k in shapes(name):
        w = make_weight(name, n, k, seed=n * k)
        dense = gguf_reference(w)
        for m in (1, 4, 6, 11):
            x = torch.randn(m, k, generator=g).to(dtype)
            y = cpu_blockq8.matmul(x, w, isa, out_dtype=torch.float32, x_bits=x_bits)
            twin = block_q8.matmul(x, w, torch.float32, x_bits)
            assert y.shape == (m, n) and y.abs().sum() > 0
            # the twin joins the exact integer dots in float64; the kernel in float32 per lane
            mag = block_q8.magnitude(x, w, x_bits).float()
            assert bool(((y - twin).abs() <= mag * 1e-5 + 1e-30).all()), (name, n, k, m)
            # the dense oracle: within the rounding of x to its int8 codes (≤ d/2 per element), plus float's
            q, d = block_q8.quantize(x, x_bits)
            err_x = (d / 2).repeat_interleave(32, 1)
            bound = err_x.double() @ dense.double().abs().t() + mag * 1e-5
            exact = x.double() @ dense.double().t()
            assert bool(((y.double() - exact).abs() <= bound * 1.001 + 1e-6).all()), (name, n, k, m)
            if dtype == torch.bfloat16:     # bf16 out is the float32 result rounded once
                assert torch.equal(cpu_blockq8.matmul(x, w, isa, x_bits=x_bits), y.to(torch.bfloat16))


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q5_K"])
@pytest.mark.parametrize("x_bits", [8, 15])
def test_rows_are_batch_invariant(isa, name, x_bits, monkeypatch):
    """Row i's bits do not depend on M, on the rows beside it, or on 1 or 2 threads."""
    monkeypatch.setattr(cpu_blockmm, "ONE_THREAD_MACS", 0)     # small calls too take the threads asked for (threads_for)
    n, k = 37, 2 * bf.FORMATS[name].block + (32 if bf.FORMATS[name].block == 32 else 0)
    w = make_weight(name, n, k, seed=11)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(max(BATCH_MS), k, generator=g).bfloat16()
    full = cpu_blockq8.matmul(x, w, isa, threads=1, x_bits=x_bits)
    assert full.float().abs().sum() > 0
    for threads in (1, 2):
        for m in BATCH_MS:
            got = cpu_blockq8.matmul(x[:m], w, isa, threads=threads, x_bits=x_bits)
            assert torch.equal(got, full[:m]), (name, threads, m)
            mixed = torch.cat([torch.randn(3, k, generator=g).bfloat16(), x[:m]])
            assert torch.equal(cpu_blockq8.matmul(mixed, w, isa, threads=threads, x_bits=x_bits)[3:], full[:m])


def test_the_levels_agree_on_the_integers_and_closely_on_y():
    """Every level computes the same integer dots; y differs only by float rounding of the lane sums."""
    w = make_weight("Q4_K", 19, 512, seed=3, random_bytes=True)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    ys = {isa: cpu_blockq8.matmul(x, w, isa) for isa in LEVELS}
    mag = block_q8.magnitude(x, w).float()
    for y in ys.values():
        assert y.abs().sum() > 0
        assert bool(((y - ys[LEVELS[0]]).abs() <= mag * 2e-5).all())


def test_bench_blockmm_reports_the_q8_kernel_for_decode_rows_only():
    from chatserve.bench import blockmm
    args = blockmm.build_parser().parse_args(["--formats", "Q4_0,F16", "--shapes", "64x64", "--rows", "1,32",
                                              "--repeats", "1", "--x-bits", "8,15", "--json"])
    rows = blockmm.run(args)
    assert [r["m"] for r in rows] == [1, 32]
    decode, prefill = rows[0]["ms"], rows[1]["ms"]
    assert {f"Q4_0/q8x{b}-{isa}" for isa in LEVELS for b in (8, 15)} <= set(decode) and all(v > 0 for v in decode.values())
    tiled = [isa for isa in cpu_blockq8.TILED_ISAS if cpu_blockq8.supported(isa)]
    assert tiled and {f"Q4_0/q8x{b}-tiled-{isa}" for isa in tiled for b in (8, 15)} <= set(decode)
    assert not any("q8" in key for key in prefill)               # past --q8-max-rows
    assert not any(key.startswith("F16/q8") for key in decode)    # no integer codes in F16


# ---- the row-interleaved (tiled) layout: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K re-laid at load, AVX2 and AVX-512 ----
TILED = [isa for isa in cpu_blockq8.TILED_ISAS if cpu_blockq8.supported(isa)]
TILED_SHAPES = [(1, 32), (16, 64), (37, 96), (40, 576)]          # n not a multiple of 16: a padded last tile
K_TILED = ("Q4_K", "Q6_K")


def tiled_shapes(name: str) -> list[tuple[int, int]]:
    return [(1, 256), (16, 512), (37, 256), (40, 768)] if name in K_TILED else TILED_SHAPES


def untile_k(data: torch.Tensor, name: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A K-quant tiled copy → codes u [n, k], ws [n, k / 16], mn [n, k / 32], read back from its bytes."""
    t, nb = (n + 15) // 16, k // 32
    if name == "Q4_K":                       # per super-block: 8 blocks of 288 bytes, then the rows' fp16 d, dmin
        s = data.reshape(t, nb // 8, 2368)
        b, dm = s[..., :2304].reshape(t, nb, 288), s[..., 2304:].contiguous().view(torch.float16).float()
    else:
        b = data.reshape(t, nb, -1)
    nib = b[..., :256].reshape(t, nb, 4, 16, 4)                              # [t, nb, c, row, i]
    u = torch.stack([nib & 15, nib >> 4], 2)                                 # [t, nb, half, c, row, i]
    if name == "Q6_K":
        hb = b[..., 256:384].reshape(t, nb, 2, 1, 16, 4)
        sh = (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 1, 4, 1, 1)
        u = u | (((hb >> sh) & 3) << 4)
        d = b[..., 384:416].contiguous().view(torch.float16).float().reshape(t, nb, 1, 16)
        ws = d * b[..., 416:448].contiguous().view(torch.int8).float().reshape(t, nb, 2, 16)
        mn = torch.zeros(t, nb, 16)
    else:
        d, dmin = dm.reshape(t, nb // 8, 1, 2, 16).repeat_interleave(8, 1).unbind(3)     # [t, nb, 1, 16]
        ws = (d * b[..., 256:272].float().reshape(t, nb, 1, 16)).expand(t, nb, 2, 16)
        mn = -(dmin.squeeze(2) * b[..., 272:288].float())
    u = u.permute(0, 4, 1, 2, 3, 5).reshape(t * 16, k)[:n]
    return (u, ws.permute(0, 3, 1, 2).reshape(t * 16, 2 * nb)[:n], mn.permute(0, 2, 1).reshape(t * 16, nb)[:n])


@pytest.mark.parametrize("isa", TILED)
@pytest.mark.parametrize("name", cpu_blockq8.TILED_FORMATS)
def test_tiled_layout_is_the_files_bytes_reordered(isa, name):
    """Same codes, same scales and mins (no second quantization), the twin's order; the file's size (Q4_0, Q4_1,
    Q8_0: its very bytes), or (Q4_K, Q6_K) the file's codes with its scales per 32 / 16 (Q4_K: 6-bit sc and min
    beside the super-block's fp16 d and dmin; Q6_K: fp16 d and int8 sc), from which ws · (u − z) + mn rebuilds
    block_formats' dequantization bit for bit."""
    assert block_q8.TILED_FORMATS == cpu_blockq8.TILED_FORMATS
    for n, k in tiled_shapes(name):
        w = make_weight(name, n, k, seed=n + k, random_bytes=True)
        t = cpu_blockq8.tile(w, isa)
        assert cpu_blockq8.tiles(isa, w) and (t.n, t.k, t.fmt) == (w.n, w.k, w.fmt)
        assert torch.equal(t.data, block_q8.tile(w).reshape(-1)), (name, n, k)
        assert t.nbytes() == (n + 15) // 16 * cpu_blockq8.tile_row_bytes(name, k)
        if name in K_TILED:
            u, ws, mn = untile_k(t.data, name, n, k)
            cu, cws, cmn = cpu_blockq8.unpack(w, isa)
            assert torch.equal(u, cu) and torch.equal(ws, cws) and torch.equal(mn, cmn)
            y = ws.repeat_interleave(16, 1) * (u.to(torch.int16) - block_q8.ZERO[name]).float()
            y = y + mn.repeat_interleave(32, 1) if name == "Q4_K" else y
            assert torch.equal(y, bf.dequantize(w)), (name, n, k)
            continue
        assert t.nbytes() == (n + 15) // 16 * 16 * w.row_bytes
        assert torch.equal(t.data.sort().values[-w.nbytes():], w.data.reshape(-1).sort().values)


@pytest.mark.parametrize("isa", TILED)
@pytest.mark.parametrize("name", cpu_blockq8.TILED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_bits", [8, 15])
def test_tiled_matmul_is_the_twins_bit_for_bit(isa, name, dtype, x_bits):
    """One float epilogue per block in increasing k (block_q8.matmul_tiled): the same bits, and within float
    rounding of the float64 join (block_q8.matmul); bf16 out is the float32 result rounded once."""
    g = torch.Generator().manual_seed(3)
    for n, k in tiled_shapes(name):
        w = make_weight(name, n, k, seed=n * k)
        t = cpu_blockq8.tile(w, isa)
        for m in (1, 4, 9, 17):
            x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)).to(dtype)
            if k > 32:
                x[0, :32] = 0                                       # an all-zero block of x
            y = cpu_blockq8.matmul_tiled(x, t, isa, out_dtype=torch.float32, x_bits=x_bits)
            assert y.abs().sum() > 0
            assert torch.equal(y, block_q8.matmul_tiled(x, w, torch.float32, x_bits)), (name, n, k, m)
            mag = block_q8.magnitude(x, w, x_bits).float()
            assert bool(((y - block_q8.matmul(x, w, torch.float32, x_bits)).abs() <= mag * 1e-5 + 1e-30).all())
            assert torch.equal(cpu_blockq8.matmul_tiled(x, t, isa, out_dtype=torch.bfloat16, x_bits=x_bits),
                               y.to(torch.bfloat16))


@pytest.mark.parametrize("isa", TILED)
def test_a_q4_k_tiled_copy_is_1_03_of_the_file_and_multiplies_as_the_file(isa):
    """Q4_K tiles per super-block of 256: 8 blocks of codes with the rows' 6-bit sc and min, then their fp16 d and
    dmin, ceil(n / 16) · (k / 256) · 2368 bytes (2368 / (16 · 144) = 1.03 of the file's). Two super-blocks and a
    padded last tile: the decode kernel gives the twin's bits on the file's blocks, and prompt rows read from the
    copy give the file's results bit for bit."""
    n, k, level = 20, 512, isa.removesuffix("-maddubs")                     # level: cpu_blockmm's
    w = make_weight("Q4_K", n, k, seed=21, random_bytes=True)
    t = cpu_blockq8.tile(w, isa)
    assert t.nbytes() == cpu_blockq8.tiled_nbytes(w) == (n + 15) // 16 * (k // 256) * 2368      # 2 · 2 · 2368
    assert 2368 / (16 * w.fmt.nbytes) < 1.03
    assert torch.equal(t.data, block_q8.tile(w).reshape(-1))
    assert torch.equal(cpu_blockmm.dequantize_tiled(t, level), bf.dequantize(w))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6))
    for x_bits in (8, 15):
        y = cpu_blockq8.matmul_tiled(x, t, isa, out_dtype=torch.float32, x_bits=x_bits)
        assert y.abs().sum() > 0
        assert torch.equal(y, block_q8.matmul_tiled(x, w, torch.float32, x_bits))
    assert torch.equal(cpu_blockmm.matmul_tiled(x, t, level), cpu_blockmm.matmul(x, w, level))


# the code bytes of each format's block (from, to) and the byte that makes every code its largest |u − z| or u
# (Q4_x/Q4_K nibbles 15, Q6_K 63, Q8_0 −128): the AVX2 level's int16 sums (pmaddubsw) are at their bound there
EXTREME_CODES = {"Q4_0": (2, 18, 0xFF), "Q4_1": (4, 20, 0xFF), "Q8_0": (2, 34, 0x80), "Q4_K": (16, 144, 0xFF),
                 "Q6_K": (0, 192, 0xFF)}


def extreme_weight(name: str, n: int, k: int) -> bf.BlockWeight:
    """Random blocks with every other row's codes at their largest (EXTREME_CODES)."""
    w = make_weight(name, n, k, seed=5, random_bytes=True)
    lo, hi, byte = EXTREME_CODES[name]
    blocks = w.data.reshape(n, -1, w.fmt.nbytes).clone()
    blocks[0::2, :, lo:hi] = byte
    return bf.BlockWeight(blocks.reshape(n, -1).contiguous(), w.fmt, n, k)


def extreme_x(m: int, k: int) -> torch.Tensor:
    """x blocks of one magnitude (every code ±top): all positive, a block all negative, or alternating."""
    sign = torch.ones(m, k)
    sign[1::2, 32:64] = -1
    sign[2 % m, :] = torch.tensor([1.0, -1.0]).repeat(k // 2)
    return sign * torch.logspace(-1, 1, m).unsqueeze(1)


@pytest.mark.parametrize("isa", TILED)
@pytest.mark.parametrize("name", cpu_blockq8.TILED_FORMATS)
@pytest.mark.parametrize("x_bits", [8, 15])
def test_tiled_integer_dots_stay_exact_at_their_largest(isa, name, x_bits):
    """Every other W row at its largest codes and x blocks of one magnitude (every code ±top, or digits ±127 in
    both planes), all of a sign or alternating: the integer sums at their largest (int16 partial sums at the
    AVX2 level: 8 · 2 · 15 · 127, 2 · 2 · 63 · 127, 2 · 128 · 127) are exact, so the twin's bits."""
    k = 512 if name in K_TILED else 128
    w, x = extreme_weight(name, 40, k), extreme_x(6, k)
    t = cpu_blockq8.tile(w, isa)
    y = cpu_blockq8.matmul_tiled(x, t, isa, out_dtype=torch.float32, x_bits=x_bits)
    assert y.abs().sum() > 0
    assert torch.equal(y, block_q8.matmul_tiled(x, w, torch.float32, x_bits)), (name, x_bits)


# The AVX2 level's AVX-VNNI branch (vpdpbusd ymm, what "avx2" runs on a CPU with AVX-VNNI) on any AVX2 CPU:
# the level-2 source built with vpdpbusd replaced by an exact AVX2 emulation (4 u8 × s8 products summed per
# int32 lane), so that branch is run against the twin where the CPU lacks AVX-VNNI too
_EMULATED_VNNI = """#pragma GCC target("no-avx512f")
#include <immintrin.h>
#define BQ8_LEVEL 2
#ifndef __AVXVNNI__
#define __AVXVNNI__ 1
#endif
static inline __m256i emulated_dpbusd(__m256i s, __m256i a, __m256i b) {
    const __m256i a0 = _mm256_and_si256(a, _mm256_set1_epi16(0xFF)), a1 = _mm256_srli_epi16(a, 8);
    const __m256i b0 = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b1 = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(a0, b0), _mm256_madd_epi16(a1, b1)));
}
#define _mm256_dpbusd_avx_epi32 emulated_dpbusd
"""


@functools.lru_cache(maxsize=1)
def emulated_vnni_library():
    lib = cpu_build.load(cpu_blockmm.level_source(cpu_blockq8.SOURCE, "avx2-emulated-vnni", _EMULATED_VNNI))
    assert lib is not None, cpu_build.status("cpu_blockq8_avx2-emulated-vnni")
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.chatserve_bq8_tile.argtypes = [i32, vp, i64, i64, i64, vp]
    lib.chatserve_bq8_tiled.argtypes = [i32, vp, i64, i64, vp, i64, i32, i32, vp, i64, i32, i32]
    lib.chatserve_bq8.argtypes = [i32, vp, i64, i64, i64, vp, i64, i32, i32, vp, i64, i32, i32]
    return lib


@pytest.mark.parametrize("name", cpu_blockq8.TILED_FORMATS)
def test_the_avx2_levels_vnni_branch_is_the_twins(name):
    """With vpdpbusd (emulated exactly), the level-2 tiled kernel is the twin's bits and the per-lane kernel
    within float rounding of its terms, on 1 and 2 threads, random and extreme codes and x."""
    assert cpu_blockq8.supported("avx2")
    lib = emulated_vnni_library()
    assert lib.chatserve_bq8_level() == 21                                   # level 2, VNNI dots
    g = torch.Generator().manual_seed(9)
    for n, k in tiled_shapes(name):
        for extreme in (False, True):
            w = extreme_weight(name, n, k) if extreme else make_weight(name, n, k, seed=n * k)
            t = torch.empty((n + 15) // 16 * cpu_blockq8.tile_row_bytes(name, k), dtype=torch.uint8)
            assert lib.chatserve_bq8_tile(w.fmt.type_id, w.data.data_ptr(), w.row_bytes, n, k, t.data_ptr()) == 0
            for m, threads in ((1, 1), (4, 2), (9, 1), (17, 2)):
                x = extreme_x(m, k) if extreme else torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)
                for x_bits in (8, 15):
                    y, y2 = torch.empty(m, n), torch.empty(m, n)
                    assert lib.chatserve_bq8_tiled(w.fmt.type_id, t.data_ptr(), n, k, x.data_ptr(), m, 0, x_bits,
                                                   y.data_ptr(), n, 0, threads) == 0
                    assert torch.equal(y, block_q8.matmul_tiled(x, w, torch.float32, x_bits)), (name, n, k, m)
                    assert lib.chatserve_bq8(w.fmt.type_id, w.data.data_ptr(), w.row_bytes, n, k, x.data_ptr(), m,
                                             0, x_bits, y2.data_ptr(), n, 0, threads) == 0
                    mag = block_q8.magnitude(x, w, x_bits).float()
                    assert bool(((y2 - block_q8.matmul(x, w, torch.float32, x_bits)).abs() <= mag * 1e-5 + 1e-30).all())


@pytest.mark.parametrize("isa", TILED)
@pytest.mark.parametrize("name", cpu_blockq8.TILED_FORMATS)
def test_tiled_rows_are_batch_invariant(isa, name, monkeypatch):
    """Row i's bits do not depend on M (row blocks of 8, 4, 2, 1 and the chunked loop above 8 rows), on the
    rows beside it, on 1 or 2 threads, or on writing into a column slice of a wider output."""
    monkeypatch.setattr(cpu_blockmm, "ONE_THREAD_MACS", 0)
    k = 256 if name in K_TILED else 96
    w = make_weight(name, 300, k, seed=13)
    t = cpu_blockq8.tile(w, isa)
    x = torch.randn(max(BATCH_MS), k, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = cpu_blockq8.matmul_tiled(x, t, isa, threads=1, x_bits=15)
    for threads in (1, 2):
        for m in BATCH_MS:
            assert torch.equal(cpu_blockq8.matmul_tiled(x[:m], t, isa, threads=threads, x_bits=15), full[:m])
            mixed = torch.cat([torch.randn(3, k).bfloat16(), x[:m]])
            wide = torch.zeros(m + 3, 310, dtype=torch.bfloat16)
            cpu_blockq8.matmul_tiled(mixed, t, isa, threads=threads, x_bits=15, out=wide[:, 5:305])
            assert torch.equal(wide[3:, 5:305], full[:m]) and not wide[:, :5].any() and not wide[:, 305:].any()
