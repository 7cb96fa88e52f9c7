"""The KV cache tensors: per layer a (key, value) pair of [num_blocks, block_size, kv_heads, head_dim],
sized from a byte budget or an exact block count, in the model dtype (or int8/fp8 codes with their
per-token scales: then a (key, value, key_scale, value_scale) tuple), on the model's device.

Not the bookkeeping (which block belongs to whom lives in chatserve/core/kv_cache_manager.py).
"""
from __future__ import annotations

import torch

from chatserve.runtime.arch_config import ArchConfig
from chatserve_kernels import quant, zero_pages

KVCaches = list[tuple[torch.Tensor, ...]]   # per layer (k, v) or (k, v, k_scale, v_scale)


def bytes_per_block(config: ArchConfig, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    """Bytes one block takes over all layers, keys and values (and scales):
    2·L·bs·kv_heads·head_dim·elem for an unquantized cache."""
    per_token = quant.kv_bytes_per_token(config.num_kv_heads, config.head_dim, dtype, kv_cache_dtype)
    return config.num_layers * block_size * per_token


def num_blocks_for_budget(config: ArchConfig, block_size: int, dtype: torch.dtype,
                          memory_bytes: int, kv_cache_dtype: str = "auto") -> int:
    per = bytes_per_block(config, block_size, dtype, kv_cache_dtype)
    n = int(memory_bytes) // per
    if n < 1:
        raise ValueError(f"a KV cache budget of {memory_bytes} B holds no {block_size}-token block "
                         f"({per} B each)")
    return n


def allocate_kv_caches(config: ArchConfig, block_size: int, dtype: torch.dtype,
                       device: str | torch.device = "cpu", num_blocks: int | None = None,
                       memory_bytes: int | None = None, kv_cache_dtype: str = "auto") -> KVCaches:
    """Zeroed caches (zeros, not empty: masked-out garbage could be NaN and poison attention). On the CPU
    the zeros cost nothing up front (zero_pages.zeros: pages the OS zeroes at first touch), so the cache's
    bytes become resident as its blocks are used, not at allocation."""
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("give num_blocks or memory_bytes")
        num_blocks = num_blocks_for_budget(config, block_size, dtype, memory_bytes, kv_cache_dtype)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if kv_cache_dtype == "auto":
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return [(zero_pages.zeros(shape, dtype, device), zero_pages.zeros(shape, dtype, device))
                for _ in range(config.num_layers)]
    caches: KVCaches = []
    for _ in range(config.num_layers):
        k, v, ks, vs = quant.allocate_kv_cache(num_blocks, block_size, config.num_kv_heads,
                                               config.head_dim, dtype, kv_cache_dtype, device)
        caches.append((k, v) if ks is None or vs is None else (k, v, ks, vs))
    return caches
