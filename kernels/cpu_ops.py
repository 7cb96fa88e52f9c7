"""Fused elementwise ops of a decoder layer on CPU (cpu_ops.c via ctypes): residual add + RMSNorm and
RoPE, each one call instead of 4-8 torch ops; SiLU·mul and the K/V row store serve the decode chain
(cpu_decode.py) and the model's CPU path alike (store_rows: the cpu-c attention backend's store). The
model uses them where usable() says so and keeps its torch code otherwise; that code is the oracle.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from chatserve_kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_ops.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _i32, _vp, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


@functools.lru_cache(maxsize=1)
def library():
    """The compiled fused ops (ctypes), or None where they cannot be built or are switched off."""
    return _bind(cpu_build.load(SOURCE))


@functools.lru_cache(maxsize=1)
def avx2_library():
    """The fused ops built at the AVX2 level even on an AVX-512 CPU (for the tests: both levels give
    SiLU·up the same bits), or None where the CPU lacks AVX2/FMA or they cannot be built."""
    if not {"avx2", "fma"} <= cpu_build.cpu_flags():
        return None
    lib = _bind(cpu_build.load(cpu_build.composed_source(
        "cpu_ops_avx2", "#define CHATSERVE_AVX2_ONLY 1\n" + SOURCE.read_text())))
    return lib if lib is not None and lib.chatserve_ops_level() == 2 else None


def _bind(lib):
    """lib with the ctypes signatures of its entry points (chatserve_ops_level: SiLU·up's level, 3 AVX-512,
    2 AVX2, 0 scalar), or None for no lib."""
    if lib is None:
        return None
    lib.chatserve_ops_level.argtypes = []
    lib.chatserve_ops_level.restype = _i32
    lib.chatserve_add_rms_norm.argtypes = [_i32, _vp, _vp, _vp, _vp, _i64, _i64, _f32, _i32]
    lib.chatserve_rope.argtypes = [_i32, _vp, _i64, _vp, _vp, _vp, _i64, _i64, _i64, _i32]
    lib.chatserve_silu_mul.argtypes = [_i32, _vp, _vp, _i64, _i64, _i32]
    lib.chatserve_store_rows.argtypes = [_vp, _vp, _i64, _vp, _vp, _vp, _i64, _i64]
    for fn in (lib.chatserve_add_rms_norm, lib.chatserve_rope, lib.chatserve_silu_mul, lib.chatserve_store_rows):
        fn.restype = None
    return lib


@functools.lru_cache(maxsize=1)
def silu_mul_address() -> int:
    """The address of chatserve_silu_mul, for the C kernels that run SiLU·up inside one call (cpu_moe,
    cpu_moe_block) with this very arithmetic; 0 without the library."""
    lib = library()
    return 0 if lib is None else ctypes.cast(lib.chatserve_silu_mul, ctypes.c_void_p).value or 0


def usable(t: torch.Tensor) -> bool:
    """The fused ops can run on tensors like t (CPU, fp32 or bf16) and the library is built."""
    return t.device.type == "cpu" and t.dtype in _DTYPES and library() is not None


def add_rms_norm(h: torch.Tensor, add: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h += add (in place, when given); returns w * rms_norm(h). h, add: [T, H] contiguous; w: [H]."""
    assert h.is_contiguous() and h.dim() == 2 and w.is_contiguous() and w.dtype == h.dtype
    if add is not None:
        assert add.is_contiguous() and add.shape == h.shape and add.dtype == h.dtype
    out = torch.empty_like(h)
    library().chatserve_add_rms_norm(_DTYPES[h.dtype], h.data_ptr(), None if add is None else add.data_ptr(),
                                     w.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], float(eps),
                                     torch.get_num_threads())
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] = [gate | up] (contiguous) → silu(gate) · up [T, I], rounded as F.silu then a multiply."""
    assert gu.is_contiguous() and gu.dim() == 2 and gu.shape[1] % 2 == 0
    T, I2 = gu.shape
    out = torch.empty(T, I2 // 2, dtype=gu.dtype)
    library().chatserve_silu_mul(_DTYPES[gu.dtype], gu.data_ptr(), out.data_ptr(), T, I2 // 2,
                                 torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """In place: x [T, heads, D] (heads contiguous, any row stride) = x·cos + roll(x, D/2)·sin at the
    rows of cos/sin [L, D] (sign folded into sin) picked by positions [T] int64."""
    T, heads, D = x.shape
    assert x.stride(2) == 1 and x.stride(1) == D and D <= 512 and D % 2 == 0
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype
    pos = positions
    if pos.dtype != torch.int64 or not pos.is_contiguous():       # a no-op .to() still dispatches
        pos = pos.to(torch.int64).contiguous()
    library().chatserve_rope(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                             pos.data_ptr(), T, heads, D, torch.get_num_threads())


def store_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor) -> bool:
    """Copy the K and V rows k, v [T, kv_heads, d] (heads contiguous; rows at one stride for both, e.g.
    views of a fused qkv) into the paged caches [num_blocks, block_size, kv_heads, d] at slots [T] int64
    (-1: skip): one C call of memcpys instead of two index_copy_ calls and their dispatch. The slots are
    trusted (the runner checked the block tables). Returns False, copying nothing, for tensors it does not
    take (another dtype than the cache's, other strides, no library): use the torch store then."""
    lib = library()
    if (lib is None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.dtype != v.dtype
            or k.dim() != 3 or v.shape != k.shape or k.shape[1:] != k_cache.shape[2:]
            or k.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(2) != 1 or v.stride(1) != v.shape[2]
            or k.stride(0) != v.stride(0) or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != k.shape[0]
            or k.device.type != "cpu"):
        return False
    esz = k.element_size()
    lib.chatserve_store_rows(k.data_ptr(), v.data_ptr(), k.stride(0) * esz, k_cache.data_ptr(), v_cache.data_ptr(),
                             slots.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * esz)
    return True
