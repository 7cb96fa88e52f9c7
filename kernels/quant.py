"""Quantized KV cache: the storage formats, their allocation, and the torch (de)quantizers.

int8 keeps a float32 scale per (token, kv head); fp8 e4m3 keeps one per (token, kv head) or one per
tensor. The Triton store kernel reproduces `quantize_torch` bit for bit; attention kernels dequantize.
"""
from __future__ import annotations

import torch

from chatserve_kernels import zero_pages

INT8_MAX = 127.0
FP8_MAX = 448.0          # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn

SCALE_NONE, SCALE_TOKEN, SCALE_TENSOR = 0, 1, 2   # kernels take these as a constexpr

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_per_tensor")
_PLAIN = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(element dtype of the cache, scale mode) for a `kv_cache_dtype` name and a model dtype."""
    if kv_cache_dtype == "auto":
        return dtype, SCALE_NONE
    if kv_cache_dtype in _PLAIN:
        return _PLAIN[kv_cache_dtype], SCALE_NONE
    if kv_cache_dtype == "int8":
        return torch.int8, SCALE_TOKEN
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8, SCALE_TOKEN
    if kv_cache_dtype == "fp8_per_tensor":
        return FP8, SCALE_TENSOR
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def allocate_kv_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, kv_cache_dtype: str = "auto",
                      device: torch.device | str = "cpu",
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One layer's paged K/V cache, zero-filled, and its scales (None for an unquantized cache). On the CPU
    the zeros are pages the OS zeroes when first touched (zero_pages.zeros), not bytes written here.

    k, v:             [num_blocks, block_size, kv_heads, head_dim] of the storage dtype
    k_scale, v_scale: [num_blocks, block_size, kv_heads] float32 (int8, fp8), [1] float32 = 1.0
                      (fp8_per_tensor), or None.
    """
    elem, mode = storage_dtype(kv_cache_dtype, dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = zero_pages.zeros(shape, elem, device)
    v = zero_pages.zeros(shape, elem, device)
    ks: torch.Tensor | None
    vs: torch.Tensor | None
    if mode == SCALE_TOKEN:
        ks = zero_pages.zeros(shape[:3], torch.float32, device)
        vs = zero_pages.zeros(shape[:3], torch.float32, device)
    elif mode == SCALE_TENSOR:
        ks = torch.ones(1, dtype=torch.float32, device=device)
        vs = torch.ones(1, dtype=torch.float32, device=device)
    else:
        ks = vs = None
    return k, v, ks, vs


def kv_bytes_per_token(kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V (with their per-token scales) one token takes in one layer."""
    elem, mode = storage_dtype(kv_cache_dtype, dtype)
    per = kv_heads * head_dim * elem.itemsize + (kv_heads * 4 if mode == SCALE_TOKEN else 0)
    return 2 * per


def scale_mode(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    """Which scale layout accompanies `cache` [NB, BS, H, D]; checks the pairing is consistent."""
    quantized = cache.dtype in (torch.int8, FP8)
    if not quantized:
        assert scale is None, f"a {cache.dtype} cache takes no scale"
        return SCALE_NONE
    assert scale is not None, f"a {cache.dtype} cache needs its scale tensor"
    assert scale.dtype == torch.float32, scale.dtype
    if scale.dim() <= 1 and scale.numel() == 1 and cache.dtype == FP8:
        return SCALE_TENSOR
    assert scale.shape == cache.shape[:3], (scale.shape, cache.shape)
    return SCALE_TOKEN


def quantize_torch(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, H, D] → (codes [T, H, D] of cache_dtype, per-token scales [T, H] float32 or None).

    With `scale` (a per-tensor fp8 scale, numel 1) it is used as is and None is returned for the scales.
    Rounding: int8 rounds half away from zero, fp8 to nearest even; both saturate.
    """
    x32 = x.float()
    if scale is not None:
        y = x32 / scale.reshape(())
        s = None
    else:
        qmax = INT8_MAX if cache_dtype == torch.int8 else FP8_MAX
        s = x32.abs().amax(dim=-1) / qmax                               # [T, H]
        y = x32 / torch.where(s > 0, s, torch.ones_like(s))[..., None]
    if cache_dtype == torch.int8:
        y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc().clamp(-INT8_MAX, INT8_MAX)
        return y.to(torch.int8), s
    return y.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype), s


def dequantize_torch(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., H, D] with scale [..., H] (per token) or [1] (per tensor) → values of `dtype`."""
    if scale is None:
        return codes.to(dtype)
    if scale.dim() <= 1:
        return (codes.float() * scale.reshape(())).to(dtype)
    return (codes.float() * scale[..., None]).to(dtype)
