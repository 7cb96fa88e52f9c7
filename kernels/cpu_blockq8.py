"""x · Wᵀ on GGUF block-format weights in place with integer activations (cpu_blockq8.c via ctypes): x rows are
quantized per block of 32 (x_bits 8: int8 codes; 15: 15-bit codes in two int8 planes, twice the dots) and
multiplied by the codes with exact integer dots, the decode path of --gguf-in-place. Built from one source at
two ISA levels: "avx512" (AVX-512 F/BW/VL + VNNI, `vpdpbusd`) and "avx2" (AVX2 + FMA + F16C, with AVX-VNNI
where the CPU has it), plus "avx2-maddubs" (AVX2 with the `pmaddubsw` dots forced, what an AVX2 CPU without
AVX-VNNI runs: tests and benchmarks). The torch twin is block_q8.py. Not a format table (block_formats.py)
and not the prompt-row kernel (cpu_blockmm.py).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from chatserve_kernels import cpu_blockmm, cpu_build
from chatserve_kernels.block_formats import BlockFormat, BlockWeight

SOURCE = Path(__file__).with_name("cpu_blockq8.c")
FORMATS = ("Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "IQ4_XS")
LEVELS = {"avx2": 2, "avx512": 3, "avx2-maddubs": 2}
_AVX2 = ("avx2", "fma", "f16c")
_NEEDS = {"avx2": _AVX2, "avx2-maddubs": _AVX2,
          "avx512": _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")}
_PRELUDE = {"avx2": '#pragma GCC target("no-avx512f")\n#define BQ8_LEVEL 2\n',
            "avx2-maddubs": '#pragma GCC target("no-avx512f,no-avxvnni")\n#define BQ8_LEVEL 2\n',
            "avx512": "#define BQ8_LEVEL 3\n"}
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def supported(isa: str) -> bool:
    """This CPU has the instructions of level `isa`."""
    return isa in _NEEDS and all(f in cpu_blockmm.cpu_flags() for f in _NEEDS[isa])


def uses_vnni(isa: str) -> bool:
    """The level's integer dots are VNNI instructions (vpdpbusd), not maddubs/madd."""
    return isa == "avx512" or (isa == "avx2" and "avx_vnni" in cpu_blockmm.cpu_flags())


@functools.lru_cache(maxsize=None)
def library(isa: str):
    """The compiled kernel of one level (ctypes), or None where it cannot run or be built."""
    if not supported(isa):
        return None
    lib = cpu_build.load(cpu_blockmm.level_source(SOURCE, isa, _PRELUDE[isa]))
    if lib is None or lib.chatserve_bq8_level() != 10 * LEVELS[isa] + int(uses_vnni(isa)):
        return None
    lib.chatserve_bq8.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _i64, _i32, _i32, _vp, _i64, _i32, _i32]
    lib.chatserve_bq8.restype = _i32
    lib.chatserve_bq8_quantize.argtypes = [_vp, _i32, _i64, _i64, ctypes.c_float, _vp, _vp]
    lib.chatserve_bq8_unpack.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _vp, _vp]
    lib.chatserve_bq8_dots.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _i64, _i32, _vp]
    lib.chatserve_bq8_tile.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp]
    lib.chatserve_bq8_tiled.argtypes = [_i32, _vp, _i64, _i64, _vp, _i64, _i32, _i32, _vp, _i64, _i32, _i32]
    for f in (lib.chatserve_bq8_quantize, lib.chatserve_bq8_unpack, lib.chatserve_bq8_dots,
              lib.chatserve_bq8_tile, lib.chatserve_bq8_tiled):
        f.restype = _i32
    return lib


def available(isa: str) -> bool:
    return library(isa) is not None


def handles(w: BlockWeight) -> bool:
    """This kernel runs W's format (F32/F16/BF16 bands stay on cpu_blockmm)."""
    return w.fmt.name in FORMATS


TOP = {8: 127.0, 15: 32512.0}       # largest code: int8, or 255 · 127 + 127 (two balanced base-255 digits)


def quantize(x: torch.Tensor, isa: str, x_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantization of x [M, K] → codes int16 [M, K] in [-TOP, TOP], scales float32 [M, K / 32]."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int16)
    d = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32)
    library(isa).chatserve_bq8_quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1],
                                        TOP[x_bits], q.data_ptr(), d.data_ptr())
    return q, d


def unpack(w: BlockWeight, isa: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's unpacking of W → codes uint8 [n, k], weight scales [n, k / 16], mins [n, k / 32]."""
    u = torch.empty(w.n, w.k, dtype=torch.uint8)
    ws = torch.empty(w.n, w.k // 16, dtype=torch.float32)
    mn = torch.empty(w.n, w.k // 32, dtype=torch.float32)
    data = w.data.contiguous()
    if library(isa).chatserve_bq8_unpack(w.fmt.type_id, data.data_ptr(), w.row_bytes, w.n, w.k, u.data_ptr(),
                                         ws.data_ptr(), mn.data_ptr()):
        raise ValueError(f"cpu_blockq8: format {w.fmt.name} not supported")
    return u, ws, mn


def dots(q: torch.Tensor, w: BlockWeight, isa: str, x_bits: int = 8) -> torch.Tensor:
    """The kernel's integer dots of x codes q [M, K] (as quantize gives them) with W's codes → int32 [M, N, K / 16]
    (Σ (u − z)·q, through two int8 planes when x_bits is 15)."""
    q = q.to(torch.int16).contiguous()
    out = torch.empty(q.shape[0], w.n, w.k // 16, dtype=torch.int32)
    data = w.data.contiguous()
    if library(isa).chatserve_bq8_dots(w.fmt.type_id, data.data_ptr(), w.row_bytes, w.n, w.k, q.data_ptr(),
                                       q.shape[0], 2 if x_bits == 15 else 1, out.data_ptr()):
        raise ValueError(f"cpu_blockq8: format {w.fmt.name} not supported")
    return out


def matmul(x: torch.Tensor, w: BlockWeight, isa: str, out_dtype: torch.dtype | None = None,
           threads: int | None = None, out: torch.Tensor | None = None, x_bits: int = 8) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 → x · Wᵀ [M, N] in out_dtype (float32 or bfloat16; default x's), x
    quantized per block of 32 to x_bits (8 or 15). out: a [M, N] view with unit column stride to write into."""
    # x: [M, K] → y: [M, N]
    assert x.dim() == 2 and x.shape[1] == w.k and x.dtype in (torch.float32, torch.bfloat16)
    x = x.contiguous()
    assert w.data.is_contiguous()
    y = out if out is not None else torch.empty(x.shape[0], w.n, dtype=out_dtype or x.dtype)
    assert y.shape == (x.shape[0], w.n) and y.dtype in (torch.float32, torch.bfloat16) and y.stride(1) == 1
    rc = library(isa).chatserve_bq8(w.fmt.type_id, w.data.data_ptr(), w.row_bytes, w.n, w.k,
                                    x.data_ptr(), x.shape[0], int(x.dtype == torch.bfloat16), x_bits,
                                    y.data_ptr(), y.stride(0), int(y.dtype == torch.bfloat16),
                                    cpu_blockmm.threads_for(threads, x.shape[0] * w.n * w.k))
    if rc:
        raise (MemoryError if rc == 2 else ValueError)(f"cpu_blockq8 failed ({rc}) on {w.fmt.name}")
    return y


# ---- the row-interleaved layout: W's blocks re-laid at load, a vector lane per output row (a zmm holds a tile's
# 16 rows; at the AVX2 levels two ymm hold rows 0-7 and 8-15 of the same layout, so one copy serves every level) ----
TILED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
TILED_ISAS = ("avx512", "avx2", "avx2-maddubs")
# bytes of one (tile of 16 rows, block of 32) in the tiled layout: 16 · the file's block for Q4_0/Q4_1/Q8_0;
# Q6_K's codes with the file's d and sc per block of 32. Q4_K per super-block of 256 instead: 8 blocks of codes
# and the rows' 6-bit sc and min (288 bytes each), then the rows' fp16 d and dmin (64), 1.03 × the file's
BLOCK_TILED_BYTES = {"Q4_0": 288, "Q4_1": 320, "Q8_0": 544, "Q6_K": 448}
Q4_K_SUPER_TILED_BYTES = 8 * 288 + 64


def tile_row_bytes(name: str, k: int) -> int:
    """Bytes of one tile (16 W rows of k columns) in the tiled layout: the kernels' tile stride."""
    return k // 256 * Q4_K_SUPER_TILED_BYTES if name == "Q4_K" else k // 32 * BLOCK_TILED_BYTES[name]


@dataclass(frozen=True)
class TiledWeight:
    """W [n, k] of a TILED_FORMATS format as chatserve_bq8_tile lays it out: the file's blocks (same codes, same
    scales and mins, no second quantization), reordered to [ceil(n / 16), tile_row_bytes(k)] so that the 16
    rows of a tile share each k-block's 64-byte chunks (one vector lane per output row). data is uint8 of
    16 · ceil(n / 16) / n times the file's bytes (Q4_0/Q4_1/Q8_0), times 1.03 (Q4_K: its 6-bit scales and mins
    a byte each) or 1.07 (Q6_K: the file's fp16 d repeated per 32 beside its int8 scales per 16)."""
    data: torch.Tensor
    fmt: BlockFormat
    n: int
    k: int

    def nbytes(self) -> int:
        return self.data.numel()


def tiles(isa: str, w: BlockWeight) -> bool:
    """This level runs W in the tiled layout."""
    return isa in TILED_ISAS and w.fmt.name in TILED_FORMATS and available(isa)


_HUGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in anonymous memory aligned to 2 MiB and advised for transparent huge pages (where the
    kernel has them): a decode step streams every tiled weight once, and 4 KiB pages would stop the hardware
    prefetcher at each page boundary and cost a TLB miss per page. Small buffers: torch's allocator."""
    if nbytes < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    whole = torch.frombuffer(m, dtype=torch.uint8)      # holds m (and so the mapping) for the tensor's life
    skip = -whole.data_ptr() % _HUGE
    return whole[skip:skip + nbytes]


def tiled_nbytes(w: BlockWeight) -> int:
    """Bytes of W's tiled copy: ceil(n / 16) tiles of tile_row_bytes."""
    return (w.n + 15) // 16 * tile_row_bytes(w.fmt.name, w.k)


def tile_into(w: BlockWeight, out: torch.Tensor, isa: str = "avx512") -> None:
    """W's blocks → the tiled layout in out (uint8 [tiled_nbytes(w)], e.g. a slice of a run's buffer or of a
    cache file's map; reads every block once)."""
    assert out.dtype == torch.uint8 and out.numel() == tiled_nbytes(w) and out.is_contiguous()
    data = w.data.contiguous()
    if library(isa).chatserve_bq8_tile(w.fmt.type_id, data.data_ptr(), w.row_bytes, w.n, w.k, out.data_ptr()):
        raise ValueError(f"cpu_blockq8: format {w.fmt.name} has no tiled layout")


def tile(w: BlockWeight, isa: str = "avx512") -> TiledWeight:
    """W's blocks → the tiled layout (a copy of W's bytes in another order, in anonymous memory)."""
    out = huge_page_buffer(tiled_nbytes(w))
    tile_into(w, out, isa)
    return TiledWeight(out, w.fmt, w.n, w.k)


def matmul_tiled(x: torch.Tensor, w: TiledWeight, isa: str = "avx512", out_dtype: torch.dtype | None = None,
                 threads: int | None = None, out: torch.Tensor | None = None, x_bits: int = 8) -> torch.Tensor:
    """As matmul, on a tiled W: x [M, K] → [M, N], one float epilogue per block and 16 output rows
    (block_q8.matmul_tiled is the twin, bit for bit)."""
    # x: [M, K] → y: [M, N]
    assert x.dim() == 2 and x.shape[1] == w.k and x.dtype in (torch.float32, torch.bfloat16)
    x = x.contiguous()
    y = out if out is not None else torch.empty(x.shape[0], w.n, dtype=out_dtype or x.dtype)
    assert y.shape == (x.shape[0], w.n) and y.dtype in (torch.float32, torch.bfloat16) and y.stride(1) == 1
    rc = library(isa).chatserve_bq8_tiled(w.fmt.type_id, w.data.data_ptr(), w.n, w.k, x.data_ptr(), x.shape[0],
                                          int(x.dtype == torch.bfloat16), x_bits, y.data_ptr(), y.stride(0),
                                          int(y.dtype == torch.bfloat16),
                                          cpu_blockmm.threads_for(threads, x.shape[0] * w.n * w.k))
    if rc:
        raise (MemoryError if rc == 2 else ValueError)(f"cpu_blockq8 tiled failed ({rc}) on {w.fmt.name}")
    return y
