"""Block copy: every copy-on-write copy of a step, over all layers, in one call."""
from __future__ import annotations

import torch


def copy_blocks_torch(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      block_mapping: torch.Tensor) -> None:
    # k_caches[l], v_caches[l]: [num_blocks, block_size, kv_heads, head_dim]
    # block_mapping: [M, 2] int64 rows of (src, dst)
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for kc, vc in zip(k_caches, v_caches):
        kc.index_copy_(0, dst, kc.index_select(0, src))
        vc.index_copy_(0, dst, vc.index_select(0, src))


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy block src → dst for each (src, dst) row of block_mapping [M, 2], in every layer."""
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2, block_mapping.shape
    copy_blocks_torch(k_caches, v_caches, block_mapping)
