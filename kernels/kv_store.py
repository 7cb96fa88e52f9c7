"""KV store: scatter a step's new keys and values into their cache slots (slot -1 = skip).

Quantizes on the way in for int8/fp8 caches (scale per token and head, or one fp8 scale per tensor).
Does not allocate or evict blocks: the slot of every token is decided by the KV cache manager.
"""
from __future__ import annotations

import torch

from chatserve_kernels.dispatch import jit, next_pow2, tl, use_triton
from chatserve_kernels.quant import (FP8_MAX, INT8_MAX, SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN,
                                     quantize_torch, scale_mode)


# --------------------------------------------------------------------------- Triton kernel
@jit
def _round_to_e4m3(y):
    # Round fp32 y (|y| <= 448) to the nearest-even e4m3 value, in fp32 arithmetic, so the final
    # cast is exact. Same result as the hardware cvt.rn on sm89+; the CPU interpreter's own fp8 cast
    # rounds half up and loses the carry into the exponent, so we never rely on it.
    e = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF                 # biased fp32 exponent
    ulp_e = tl.maximum(e - 127, -6) - 3                              # e4m3: 3 mantissa bits, min exp -6
    magic = ((ulp_e + 23 + 127) << 23) | 0x400000                  # 1.5 * 2^23 * ulp
    c = magic.to(tl.float32, bitcast=True)
    r = (tl.abs(y) + c) - c                                          # fp32 add rounds to a multiple of ulp
    return tl.where(y < 0, -r, r)                                    # keeps -0.0 like torch


@jit
def _quantize_store(x_ptr, stride_xt, stride_xh, cache_ptr, scale_ptr, t, blk, off, slot,
                    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                    D_PAD: tl.constexpr, SCALE_MODE: tl.constexpr, IS_INT8: tl.constexpr,
                    QMAX: tl.constexpr):
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    head_ok = (h < HEADS) & ((h * 0 + slot) >= 0)     # vector form: the interpreter rejects scalar & vector
    mask = head_ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)                                                   # x: [H_PAD, D_PAD]
    dst = cache_ptr + blk * stride_cb + off * stride_ct + h[:, None] * stride_ch + d[None, :]
    if SCALE_MODE == 0:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        if SCALE_MODE == 1:
            s = tl.div_rn(tl.max(tl.abs(x), axis=1), QMAX)                    # s: [H_PAD]
            s_safe = tl.where(s > 0.0, s, 1.0)
            y = tl.div_rn(x, s_safe[:, None])
            tl.store(scale_ptr + blk * stride_sb + off * stride_st + h * stride_sh, s,
                     mask=head_ok)
        else:
            y = tl.div_rn(x, tl.load(scale_ptr))
        if IS_INT8:
            y = tl.where(y >= 0.0, y + 0.5, y - 0.5)
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.int8)         # fp → int truncates
        else:
            y = _round_to_e4m3(tl.minimum(tl.maximum(y, -QMAX), QMAX))
            y = y.to(cache_ptr.dtype.element_ty)
        tl.store(dst, y, mask=mask)


@jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                     BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr, SCALE_MODE: tl.constexpr,
                     IS_INT8: tl.constexpr, QMAX: tl.constexpr):
    # one program per new token, all kv heads at once
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    blk = tl.maximum(slot, 0) // BLOCK_SIZE
    off = tl.maximum(slot, 0) % BLOCK_SIZE
    _quantize_store(key_ptr, stride_kt, stride_kh, k_cache_ptr, k_scale_ptr, t, blk, off, slot,
                    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                    HEADS, HEAD_DIM, H_PAD, D_PAD, SCALE_MODE, IS_INT8, QMAX)
    _quantize_store(value_ptr, stride_vt, stride_vh, v_cache_ptr, v_scale_ptr, t, blk, off, slot,
                    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                    HEADS, HEAD_DIM, H_PAD, D_PAD, SCALE_MODE, IS_INT8, QMAX)


# --------------------------------------------------------------------------- launcher
def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    # key, value: [T, H, D]; k_cache, v_cache: [NB, BS, H, D]; slot_mapping: [T] int64;
    # k_scale, v_scale: [NB, BS, H] float32 | [1] float32 | None
    T, H, D = key.shape
    nb, bs, hc, dc = k_cache.shape
    assert (hc, dc) == (H, D) and v_cache.shape == k_cache.shape, (key.shape, k_cache.shape)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches need one dense layout"
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64, slot_mapping.dtype
    mode = scale_mode(k_cache, k_scale)
    assert scale_mode(v_cache, v_scale) == mode
    if T == 0:
        return
    if mode == SCALE_TOKEN:
        assert k_scale is not None and v_scale is not None
        assert k_scale.stride() == v_scale.stride(), "k/v scales need one layout"
        sstr = k_scale.stride()
    else:
        sstr = (0, 0, 0)
    dummy = k_cache  # never dereferenced when SCALE_MODE == 0
    is_int8 = k_cache.dtype == torch.int8
    _store_kv_kernel[(T,)](
        key, value, k_cache, v_cache,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), sstr[0], sstr[1], sstr[2],
        BLOCK_SIZE=bs, HEADS=H, HEAD_DIM=D, H_PAD=next_pow2(H), D_PAD=next_pow2(D),
        SCALE_MODE=mode, IS_INT8=is_int8, QMAX=INT8_MAX if is_int8 else FP8_MAX,
        num_warps=4 if H * D >= 1024 else 2,
    )


# --------------------------------------------------------------------------- torch twin
def store_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, all_valid: bool = False) -> None:
    # key, value:       [T, kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    # slot_mapping:     [T] int64
    nb, bs, h, d = k_cache.shape
    mode = scale_mode(k_cache, k_scale)
    if not all_valid:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if mode == SCALE_NONE:
            cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        codes, s = quantize_torch(x, cache.dtype, scale if mode == SCALE_TENSOR else None)
        # index_copy_ is not implemented for float8 on CPU: copy the raw bytes instead
        cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, codes.view(torch.uint8))
        if mode == SCALE_TOKEN:
            assert scale is not None and s is not None
            scale.view(nb * bs, h).index_copy_(0, slot_mapping, s)


# --------------------------------------------------------------------------- public
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, all_valid: bool = False) -> None:
    """Write key/value [T, kv_heads, head_dim] into the paged caches at slot_mapping [T] (-1 = skip).

    all_valid: the caller knows no slot is -1, so the CPU path skips a per-call check (a sync).

    Quantized caches (int8, float8_e4m3fn) take their scale tensors (see quant.allocate_kv_cache).
    """
    assert key.shape == value.shape and key.dim() == 3, key.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:], (k_cache.shape, key.shape)
    assert slot_mapping.shape == (key.shape[0],), slot_mapping.shape
    if use_triton(k_cache):
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, all_valid)
