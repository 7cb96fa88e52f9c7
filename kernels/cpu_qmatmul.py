"""Weight-only 4/8-bit matmul for few-row CPU steps (cpu_qmatmul.c via ctypes: AVX-512 VNNI, or AVX2 + FMA +
F16C with AVX-VNNI or maddubs): packs a matrix once into the kernel's tiled layout and multiplies bf16/fp32 rows
by it. `dequantize` is the plain-torch twin of the packed weights (the test oracle); without AVX2 `available()`
is False. Every level gives a row the same bits (`level_library` builds one on demand, for the tests).
"""
from __future__ import annotations

import ctypes
import functools
import os
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from chatserve_kernels import cpu_blockq8, cpu_build, env

SOURCE = Path(__file__).with_name("cpu_qmatmul.c")
GROUP = 32
TILE = 16
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


# Levels a build can be forced to (a prelude before the source; the levels, and the CPU flags each needs, are
# cpu_blockq8's), and what chatserve_qmm_level() answers: 10 · level + 1 where its dots are VNNI instructions.
LEVELS = {"avx512": "#define QMM_LEVEL 3\n", "avx2": "#define QMM_LEVEL 2\n",
          "avx2-maddubs": "#define QMM_LEVEL 2\n#define QMM_MADDUBS 1\n"}
CODES = {"avx512": 31, "avx2": 21, "avx2-maddubs": 20}


def _bind(lib):
    if lib is None or lib.chatserve_qmm_tile() != TILE:
        return None
    lib.chatserve_qmm.argtypes = [_vp, _vp, _i32, _i64, _i64, _vp, _i64, _vp, _i32, _i32]
    lib.chatserve_qmm.restype = _i32
    return lib


@functools.lru_cache(maxsize=1)
def library():
    """The compiled matmul at the best level this CPU has (ctypes), or None where it cannot be built or is
    switched off."""
    return _bind(cpu_build.load(SOURCE))


def available() -> bool:
    """The kernel is built for this CPU (and not switched off with CHATSERVE_CPU_KERNELS=0)."""
    return library() is not None


def level() -> str:
    """The level library() runs: "avx512", "avx2" (AVX-VNNI dots), "avx2-maddubs", or "" when unavailable."""
    lib = library()
    return {c: lv for lv, c in CODES.items()}.get(lib.chatserve_qmm_level(), "?") if lib else ""


def supported_levels() -> list[str]:
    """The levels this CPU can run ("avx2" only where it has AVX-VNNI; "avx2-maddubs" wherever AVX2 is)."""
    return [lv for lv in LEVELS if cpu_blockq8.supported(lv) and (lv != "avx2" or cpu_blockq8.uses_vnni(lv))]


@functools.lru_cache(maxsize=None)
def level_library(name: str):
    """The matmul built at level `name` (one of supported_levels()), or None where it cannot be."""
    if name not in supported_levels():
        return None
    lib = _bind(cpu_build.load(cpu_build.composed_source(
        f"cpu_qmatmul_{name.replace('-', '_')}", LEVELS[name] + SOURCE.read_text())))
    return lib if lib is not None and lib.chatserve_qmm_level() == CODES[name] else None


@dataclass
class PackedWeight:
    """W [N, K] as codes in the kernel's layout: value = lo + code · scale per (row, group of 32)."""
    codes: torch.Tensor     # uint8 [tiles, G, 8 (8-bit) or 4 (4-bit), 64]
    scale_lo: torch.Tensor  # float16 [tiles, G, 32]: the tile's 16 scales, then its 16 lows
    bits: int
    n: int
    k: int

    @functools.cached_property
    def ptrs(self) -> tuple[int, int]:
        """Data pointers of codes and scale_lo (fixed for the weight's life): the C call's arguments."""
        return self.codes.data_ptr(), self.scale_lo.data_ptr()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale_lo))


FP16_MAX = 65504.0


# A group off the min/max grid (errs by more than w's own rounding, OFF_GRID × max|w|) tries the grids a GGUF
# block of the file may lie on, value = lo + code · scale with scale and lo exact in fp16 when the block's d is:
#   Q4_0 d·(q - 8), extreme at q = 0 (its quantizers put it there): lo = the extreme, scale = -extreme / 8;
#   Q4_0 with no code at its extreme (random codes, importance-weighted quantizers): scale = ±min |w| ≠ 0
#        (some |q - 8| = 1 among 32 codes), lo = -8 · scale;
#   Q8_0 d·q, |q| ≤ 127 (8 bits): scale = max|w| / 127, lo = -128 · scale.
# Q4_1 (d·q + m, q = 0 and 15 both used) is the min/max grid itself. Each group keeps the grid that rebuilds it
# best. (lo stays near the group's values: the kernel's x codes err by up to |lo + code·scale| per weight.)
OFF_GRID = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}   # × max|w|
QUANT_ROWS = 2048          # rows per slice: bounds the float32 temporaries of a vocabulary-sized matrix

Grid = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]     # codes, scale, lo, error


def _grid_codes(g: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, top: int) -> Grid:
    """g [..., 32] on the grid (scale, lo [...], rounded to fp16 as stored) → codes [..., 32], scale, lo and
    the largest rebuild error per group [...] (to float32's rounding of (w - lo) / scale)."""
    scale = torch.where(scale < 0, scale.clamp(-FP16_MAX, -2 ** -24), scale.clamp(2 ** -24, FP16_MAX))
    scale, lo = scale.half().float(), lo.clamp(-FP16_MAX, FP16_MAX).half().float()
    r = (g - lo[..., None]).div_(scale[..., None])                               # w in steps above lo
    codes = torch.round(r).clamp_(0, top)
    err = r.sub_(codes).abs_().amax(-1).mul_(scale.abs())
    return codes, scale, lo, err


def _extreme_grid(g: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Q4_0 with its extreme at q = 0: (scale, lo) [m] for the groups g [m, 32]."""
    lo, hi = g.amin(-1), g.amax(-1)
    extreme = torch.where(-lo > hi, lo, hi)                                         # the signed max|w|
    return [(-extreme / 8, extreme)]


def _smallest_grid(g: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Q4_0 by its smallest nonzero |w| (either sign of d)."""
    a = g.abs()
    small = a.masked_fill(a == 0, float("inf")).amin(-1).nan_to_num(0.0, posinf=0.0).half().float()
    return [(small, -8 * small), (-small, 8 * small)]


def _q8_0_grid(g: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    step = (g.abs().amax(-1) / 127).half().float()
    return [(step, -128 * step)]


# the GGUF grids tried, stage by stage, on the groups the stages before left off the grid
FILE_GRIDS = {4: (_extreme_grid, _smallest_grid), 8: (_extreme_grid, _q8_0_grid)}


def quantize(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes per group of 32 along K: w [N, K] → (codes [N, K] int32, scale, lo [N, G]), scale and
    lo rounded to fp16 (as the kernel stores them) before the codes are chosen. Min/max per group, or the grid
    of a GGUF block where that rebuilds it better, so weights dequantized from a file's Q4_0 / Q4_1 (Q8_0 at 8
    bits) blocks come back exactly instead of being rounded a second time."""
    N, K = w.shape
    top = (1 << bits) - 1
    tol = OFF_GRID.get(w.dtype, 0.0)
    out = [torch.empty(N, K, dtype=torch.int32), torch.empty(N, K // GROUP), torch.empty(N, K // GROUP)]
    for a in range(0, N, QUANT_ROWS):
        g = w[a:a + QUANT_ROWS].float().reshape(-1, GROUP)                         # [n·G, 32]
        lo, hi = g.amin(-1), g.amax(-1)
        best = _grid_codes(g, (hi - lo) / top, lo, top)
        idx = (best[3] > torch.maximum(hi, -lo) * tol).nonzero()[:, 0]             # groups off the grid [m]
        for stage in FILE_GRIDS[bits]:
            if idx.numel() == 0:
                break
            sub = g.index_select(0, idx)                                            # [m, 32]
            pick = [t.index_select(0, idx) for t in best]
            for scale, low in stage(sub):
                cand = _grid_codes(sub, scale, low, top)
                better = cand[3] < pick[3]                                          # [m]
                pick = [torch.where(better.view(-1, *([1] * (c.dim() - 1))), c, p) for c, p in zip(cand, pick)]
            for t, p in zip(best, pick):
                t.index_copy_(0, idx, p)
            idx = idx[pick[3] > sub.abs().amax(-1) * tol]
        codes, scale, lo, _ = best
        out[0][a:a + QUANT_ROWS] = codes.reshape(-1, K).to(torch.int32)
        out[1][a:a + QUANT_ROWS] = scale.view(-1, K // GROUP)
        out[2][a:a + QUANT_ROWS] = lo.view(-1, K // GROUP)
    return out[0], out[1], out[2]


def pack(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int) -> PackedWeight:
    """codes [N, K] (0 .. 2**bits - 1), scale and lo [N, K/32] (fp16 values) → cpu_qmatmul.c's layout."""
    assert bits in (4, 8)
    N, K = codes.shape
    G = K // GROUP
    assert K % GROUP == 0 and scale.shape == lo.shape == (N, G)
    tiles = -(-N // TILE)
    pad = tiles * TILE - N
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad)).reshape(tiles, TILE, G, GROUP)
    if bits == 8:         # chunk j, byte 4·r + i: k = 4·j + i
        c = c.reshape(tiles, TILE, G, 8, 4).permute(0, 2, 3, 1, 4)                # [tiles, G, 8, row, 4]
    else:                 # chunk c, byte 4·r + i: k = 8·c + i (low nibble) and 8·c + 4 + i (high)
        c = c.reshape(tiles, TILE, G, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)          # [tiles, G, c, row, i, half]
        c = c[..., 0] | (c[..., 1] << 4)
    codes_t = c.reshape(tiles, G, 8 if bits == 8 else 4, 64).contiguous()

    def tiled(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t.half(), (0, 0, 0, pad))
        return t.reshape(tiles, TILE, G).transpose(1, 2)                       # [tiles, G, 16]
    return PackedWeight(codes_t, torch.cat([tiled(scale), tiled(lo)], -1).contiguous(), bits, N, K)


CACHE_FORMAT = 1          # bump when quantize() or pack() would give other bytes for the same w


def pack_cached(w: torch.Tensor, bits: int) -> PackedWeight:
    """pack(*quantize(w, bits), bits), kept on disk under <cache root>/qmatmul by a hash of w's bytes, dtype, shape
    and bits: a later load of the same weights (a server restart) maps the packed copy instead of quantizing
    again (a default-model server start 24-26 s -> 14-15 s on a loaded AVX2 box; the test suite keeps its own
    directory, CHATSERVE_WEIGHT_CACHE_DIR).
    A file is written under a temporary name and renamed, so concurrent loads are safe; an unreadable one is
    quantized again and replaced. CHATSERVE_WEIGHT_CACHE=0 turns it off."""
    if not env.weight_cache_enabled():
        return pack(*quantize(w, bits), bits)
    wc = w.detach().contiguous()
    raw = wc.view(torch.uint8).reshape(-1).numpy()
    digest = xxhash.xxh3_128_hexdigest(raw)  # type: ignore[arg-type]  # an ndarray is a buffer; its stubs say otherwise
    name = f"{digest}-{str(wc.dtype)[6:]}-{wc.shape[0]}x{wc.shape[1]}-{bits}b-v{CACHE_FORMAT}.pt"
    path = env.weight_cache_dir() / name
    try:
        d = torch.load(path, mmap=True, weights_only=True)
        return PackedWeight(d["codes"], d["scale_lo"], bits, wc.shape[0], wc.shape[1])
    except (OSError, RuntimeError, KeyError, pickle.UnpicklingError):
        pass
    p = pack(*quantize(wc, bits), bits)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        torch.save({"codes": p.codes, "scale_lo": p.scale_lo}, tmp)
        os.replace(tmp, path)
    except OSError:
        pass                       # a read-only or full cache: the weights are still packed in memory
    return p


def dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The torch twin: codes [N, K], scale and lo [N, G] → W [N, K] float32."""
    N, K = codes.shape
    g = codes.float().reshape(N, K // GROUP, GROUP)
    return (lo[..., None] + g * scale[..., None]).reshape(N, K)


def matmul(x: torch.Tensor, w: PackedWeight, lib=None) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 → x · Wᵀ [M, N] of x's dtype. x enters as 15-bit codes per group of 32
    for 4-bit weights and for 8-bit ones under fp32 x, as int8 codes for 8-bit ones under bf16 x (qmm_planes in
    cpu_qmatmul.c). lib: a level_library() (default: library())."""
    assert x.dim() == 2 and x.shape[1] == w.k and x.dtype in (torch.float32, torch.bfloat16)
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.n, dtype=x.dtype)
    rc = (lib or library()).chatserve_qmm(*w.ptrs, w.bits, w.n, w.k,
                                 x.data_ptr(), x.shape[0], y.data_ptr(), int(x.dtype == torch.bfloat16),
                                 torch.get_num_threads())
    if rc:
        raise MemoryError("cpu_qmatmul: scratch allocation failed")
    return y
