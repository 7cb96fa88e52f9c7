"""KV store: scatter a step's new keys and values into their cache slots (slot -1 = skip)."""
from __future__ import annotations

import torch


def store_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # key, value:       [T, kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    # slot_mapping:     [T] int64
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, kv_heads, head_dim] into the paged caches at slot_mapping [T]."""
    assert key.shape == value.shape and key.dim() == 3, key.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:], (k_cache.shape, key.shape)
    assert slot_mapping.shape == (key.shape[0],), slot_mapping.shape
    store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
