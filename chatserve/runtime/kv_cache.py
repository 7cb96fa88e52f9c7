"""The KV cache tensors: per layer a (key, value) pair of [num_blocks, block_size, kv_heads, head_dim],
sized from a byte budget or an exact block count, in the model dtype, on the model's device.

Not the bookkeeping (which block belongs to whom lives in chatserve/core/kv_cache_manager.py).
"""
from __future__ import annotations

import torch

from chatserve.runtime.weights import ArchConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def bytes_per_block(config: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values: 2·L·bs·kv_heads·head_dim·elem."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def num_blocks_for_budget(config: ArchConfig, block_size: int, dtype: torch.dtype,
                          memory_bytes: int) -> int:
    n = int(memory_bytes) // bytes_per_block(config, block_size, dtype)
    if n < 1:
        raise ValueError(f"a KV cache budget of {memory_bytes} B holds no {block_size}-token block "
                         f"({bytes_per_block(config, block_size, dtype)} B each)")
    return n


def allocate_kv_caches(config: ArchConfig, block_size: int, dtype: torch.dtype,
                       device: str | torch.device = "cpu", num_blocks: int | None = None,
                       memory_bytes: int | None = None) -> KVCaches:
    """Zeroed caches (zeros, not empty: masked-out garbage could be NaN and poison attention)."""
    if num_blocks is None:
        if memory_bytes is None:
            raise ValueError("give num_blocks or memory_bytes")
        num_blocks = num_blocks_for_budget(config, block_size, dtype, memory_bytes)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]
