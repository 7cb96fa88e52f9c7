"""x · Wᵀ on GGUF block-format weights in place (cpu_blockmm.c via ctypes), at two ISA levels built from one
source: "avx2" (AVX2 + FMA + F16C) and "avx512" (AVX-512 F/BW/VL). `detect_isa()` reads the CPU's flags
once; a caller may force the lower level on an AVX-512 CPU (tests, benchmarks). The torch twin is
block_formats.matmul_torch. Not a format table (block_formats.py) and not a weight loader.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Protocol

import torch

from chatserve_kernels import cpu_build, env
from chatserve_kernels.block_formats import BlockFormat, BlockWeight

SOURCE = Path(__file__).with_name("cpu_blockmm.c")
HELPERS = Path(__file__).with_name("block_bytes.h")    # written before each block kernel's source
LEVELS = {"avx2": 2, "avx512": 3}
_NEEDS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
          "amx": ("amx_tile", "amx_bf16")}
# prepended to the shared source per level; the AVX2 build switches AVX-512 off even under -march=native
_PRELUDE = {"avx2": '#pragma GCC target("no-avx512f")\n#define BMM_LEVEL 2\n', "avx512": "#define BMM_LEVEL 3\n"}
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# calls under this many multiply-adds run on one thread: a parallel region costs more than it saves there
# (and on a loaded machine a 2-thread region waits for a descheduled thread). Results do not depend on it.
ONE_THREAD_MACS = 1 << 22


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported(isa: str) -> bool:
    """This CPU has the instructions of level `isa`."""
    return all(f in cpu_flags() for f in _NEEDS[isa])


def detect_isa() -> str | None:
    """The best level this CPU runs ("avx512", "avx2"), or None (the torch twin then)."""
    return next((isa for isa in ("avx512", "avx2") if supported(isa)), None)


@functools.lru_cache(maxsize=None)
def library(isa: str):
    """The compiled kernel of one level (ctypes), or None where it cannot run or be built."""
    if isa not in LEVELS or not supported(isa):
        return None
    lib = cpu_build.load(_level_source(isa))
    if lib is None or lib.chatserve_bmm_level() != LEVELS[isa]:
        return None
    lib.chatserve_bmm.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp, _i64, _i32, _vp, _i64, _i32, _i32]
    lib.chatserve_bmm.restype = _i32
    lib.chatserve_bmm_dequant.argtypes = [_i32, _vp, _i64, _i64, _i64, _vp]
    lib.chatserve_bmm_dequant.restype = _i32
    lib.chatserve_bmm_amx.argtypes = [_i32]
    lib.chatserve_bmm_amx.restype = _i32
    lib.chatserve_bmm_amx(int(isa == "avx512" and supported("amx") and env.cpu_amx_enabled()))
    return lib


def _level_source(isa: str) -> Path:
    return level_source(SOURCE, isa, _PRELUDE[isa])


def level_source(source: Path, tag: str, prelude: str) -> Path:
    """One source with a level's prelude and the shared byte helpers (block_bytes.h), written once into the
    kernel cache (named by content); shared by the block kernels built at several ISA levels (cpu_blockmm,
    cpu_blockq8)."""
    return cpu_build.composed_source(f"{source.stem}_{tag}", prelude + HELPERS.read_text() + source.read_text())


def available(isa: str) -> bool:
    return library(isa) is not None


def amx(isa: str) -> bool:
    """Level `isa` runs bf16 x on AMX-BF16 tiles (the CPU has amx_tile + amx_bf16, the build has them and
    Linux granted the tile state): W is then rounded to bf16 for those calls (`rounds_w(isa, dtype)`)."""
    lib = library(isa)
    return lib is not None and bool(lib.chatserve_bmm_amx(-1))


def use_amx(isa: str, on: bool) -> bool:
    """Switch level `isa`'s AMX path on (where it can run) or off (the fp32 dot products for bf16 x too: tests,
    A/B benchmarks); returns whether it is on. Results of one setting never depend on M or threads."""
    lib = library(isa)
    return lib is not None and bool(lib.chatserve_bmm_amx(int(on)))


def rounds_w(isa: str, x_dtype: torch.dtype) -> bool:
    """Whether a matmul of `x_dtype` rows at level `isa` runs on W rounded to bf16 (the AMX path)."""
    return x_dtype == torch.bfloat16 and amx(isa)


def dequantize(w: BlockWeight, isa: str) -> torch.Tensor:
    """The kernel's own dequantization of W → [n, k] float32 (tests hold it bit-equal to the twin's)."""
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    data = w.data.contiguous()
    rc = library(isa).chatserve_bmm_dequant(w.fmt.type_id, data.data_ptr(), w.row_bytes, w.n, w.k,
                                            out.data_ptr())
    if rc:
        raise ValueError(f"cpu_blockmm: format {w.fmt.name} not supported")
    return out


def threads_for(asked: int | None, macs: int) -> int:
    """Threads for a call of `macs` multiply-adds: one below ONE_THREAD_MACS (a parallel region costs more
    than it saves there), else `asked` or torch's count. Results never depend on it (threads split columns)."""
    return 1 if macs < ONE_THREAD_MACS else asked or torch.get_num_threads()


def matmul(x: torch.Tensor, w: BlockWeight, isa: str, out_dtype: torch.dtype | None = None,
           threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 → x · Wᵀ [M, N] in out_dtype (float32 or bfloat16; default x's).
    out: a [M, N] view with unit column stride (e.g. a column slice of a wider output) to write into."""
    # x: [M, K] → y: [M, N]
    assert x.dim() == 2 and x.shape[1] == w.k and x.dtype in (torch.float32, torch.bfloat16)
    x = x.contiguous()
    assert w.data.is_contiguous()
    y = out if out is not None else torch.empty(x.shape[0], w.n, dtype=out_dtype or x.dtype)
    assert y.shape == (x.shape[0], w.n) and y.dtype in (torch.float32, torch.bfloat16) and y.stride(1) == 1
    rc = library(isa).chatserve_bmm(w.fmt.type_id, w.data.data_ptr(), w.row_bytes, w.n, w.k,
                                    x.data_ptr(), x.shape[0], int(x.dtype == torch.bfloat16),
                                    y.data_ptr(), y.stride(0), int(y.dtype == torch.bfloat16),
                                    threads_for(threads, x.shape[0] * w.n * w.k))
    if rc:
        raise (MemoryError if rc == 2 else ValueError)(f"cpu_blockmm failed ({rc}) on {w.fmt.name}")
    return y


# ---- a tiled source: W as cpu_blockq8's row-interleaved copy (the decode rows' layout), read by prompt rows so that
# the mapped file's pages of tiled bands are never touched after load; same values, same results bit for bit ----
TILED = 0x100                                      # cpu_blockmm.c's flag on the format id
TILED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


class Tiled(Protocol):
    """What these calls read of cpu_blockq8.TiledWeight (that module imports this one)."""
    @property
    def data(self) -> torch.Tensor: ...
    @property
    def fmt(self) -> BlockFormat: ...
    @property
    def n(self) -> int: ...
    @property
    def k(self) -> int: ...


def _tile_bytes(w: Tiled) -> int:
    """Bytes of one tile of 16 rows (the kernel's row stride for a tiled source)."""
    assert w.fmt.name in TILED_FORMATS and w.data.is_contiguous() and w.data.data_ptr() % 16 == 0
    return w.data.numel() // ((w.n + 15) // 16)


def dequantize_tiled(w: Tiled, isa: str) -> torch.Tensor:
    """The kernel's dequantization of a tiled W → [n, k] float32 (equal to dequantize() of the file's blocks)."""
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    if library(isa).chatserve_bmm_dequant(w.fmt.type_id | TILED, w.data.data_ptr(), _tile_bytes(w), w.n, w.k,
                                          out.data_ptr()):
        raise ValueError(f"cpu_blockmm: tiled {w.fmt.name} not supported")
    return out


def matmul_tiled(x: torch.Tensor, w: Tiled, isa: str, out_dtype: torch.dtype | None = None,
                 threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """As matmul, W read from its tiled copy: the same bits as matmul on the file's blocks."""
    # x: [M, K] → y: [M, N]
    assert x.dim() == 2 and x.shape[1] == w.k and x.dtype in (torch.float32, torch.bfloat16)
    x = x.contiguous()
    y = out if out is not None else torch.empty(x.shape[0], w.n, dtype=out_dtype or x.dtype)
    assert y.shape == (x.shape[0], w.n) and y.dtype in (torch.float32, torch.bfloat16) and y.stride(1) == 1
    rc = library(isa).chatserve_bmm(w.fmt.type_id | TILED, w.data.data_ptr(), _tile_bytes(w), w.n, w.k,
                                    x.data_ptr(), x.shape[0], int(x.dtype == torch.bfloat16),
                                    y.data_ptr(), y.stride(0), int(y.dtype == torch.bfloat16),
                                    threads_for(threads, x.shape[0] * w.n * w.k))
    if rc:
        raise (MemoryError if rc == 2 else ValueError)(f"cpu_blockmm failed ({rc}) on tiled {w.fmt.name}")
    return y
