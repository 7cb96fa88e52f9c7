"""Block copy: every copy-on-write copy of a step, over all layers (and their KV scales), in one launch.

The Triton path copies raw 32-bit words through a table of per-layer base pointers, so any cache dtype
works. It does not decide which blocks to copy: the KV cache manager's CopyOps do.
"""
from __future__ import annotations

import torch

from chatserve_kernels.dispatch import cdiv, jit, tl, use_triton

_CHUNK = 1024  # 32-bit words per program


# --------------------------------------------------------------------------- Triton kernel
@jit
def _copy_blocks_kernel(table_ptr, mapping_ptr, NUM_BUFS: tl.constexpr, CHUNK: tl.constexpr):
    # table: [3, NUM_BUFS] int64 rows (base address, block stride in words, words per block)
    pair = tl.program_id(0).to(tl.int64)
    buf = tl.program_id(1)
    chunk = tl.program_id(2).to(tl.int64)
    base = tl.load(table_ptr + buf).to(tl.pointer_type(tl.int32))
    stride = tl.load(table_ptr + NUM_BUFS + buf)
    words = tl.load(table_ptr + 2 * NUM_BUFS + buf)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words
    x = tl.load(base + src * stride + offs, mask=mask)
    tl.store(base + dst * stride + offs, x, mask=mask)


# --------------------------------------------------------------------------- launcher
_TABLES: dict[tuple, torch.Tensor] = {}  # pointer tables, keyed by the buffers' addresses and layouts


def _pointer_table(bufs: list[torch.Tensor]) -> torch.Tensor:
    key = tuple((b.data_ptr(), b.shape, b.stride(), b.dtype, str(b.device)) for b in bufs)
    table = _TABLES.get(key)
    if table is None:
        rows: list[list[int]] = [[], [], []]
        for b in bufs:
            block_bytes = b[0].numel() * b.element_size()
            assert b[0].is_contiguous(), "each block must be contiguous"
            assert block_bytes % 4 == 0 and b.data_ptr() % 4 == 0, "blocks must be whole 32-bit words"
            assert (b.stride(0) * b.element_size()) % 4 == 0
            rows[0].append(b.data_ptr())
            rows[1].append(b.stride(0) * b.element_size() // 4)
            rows[2].append(block_bytes // 4)
        table = torch.tensor(rows, dtype=torch.int64, device=bufs[0].device)   # [3, NUM_BUFS]
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = table
    return table


def copy_blocks_triton(buffers: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    # buffers[i]: [num_blocks, ...] any dtype, each block contiguous; block_mapping: [M, 2] int64
    M = block_mapping.shape[0]
    if M == 0 or not buffers:
        return
    nb = buffers[0].shape[0]
    assert all(b.shape[0] == nb and b.device == buffers[0].device for b in buffers)
    mapping = block_mapping.to(device=buffers[0].device, dtype=torch.int64).contiguous()
    table = _pointer_table(buffers)
    max_words = max(b[0].numel() * b.element_size() // 4 for b in buffers)
    grid = (M, len(buffers), cdiv(max_words, _CHUNK))
    _copy_blocks_kernel[grid](table, mapping, NUM_BUFS=len(buffers), CHUNK=_CHUNK, num_warps=4)


# --------------------------------------------------------------------------- torch twin
def copy_blocks_torch(buffers: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    # buffers[i]: [num_blocks, ...]; block_mapping: [M, 2] int64 rows of (src, dst)
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for b in buffers:
        raw = b.view(torch.uint8) if b.dtype.itemsize == 1 else b   # index_copy_ lacks float8 on CPU
        raw.index_copy_(0, dst, raw.index_select(0, src))


# --------------------------------------------------------------------------- public
def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor,
                k_scales: list[torch.Tensor | None] | None = None,
                v_scales: list[torch.Tensor | None] | None = None) -> None:
    """Copy block src → dst for each (src, dst) row of block_mapping [M, 2], in every layer.

    k_caches[l], v_caches[l]: [num_blocks, block_size, kv_heads, head_dim]; k_scales[l], v_scales[l]:
    [num_blocks, block_size, kv_heads] per-token scales of a quantized cache (per-tensor scales and None
    entries are skipped). A dst must not also be a src in the same call.
    """
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2, block_mapping.shape
    assert len(k_caches) == len(v_caches)
    bufs = list(k_caches) + list(v_caches)
    for scales in (k_scales, v_scales):
        for s in scales or []:
            if s is not None and s.dim() == 3:
                bufs.append(s)
    if block_mapping.numel() == 0 or not bufs:
        return
    if use_triton(bufs[0]):
        copy_blocks_triton(bufs, block_mapping)
    else:
        copy_blocks_torch(bufs, block_mapping.to(device=bufs[0].device, dtype=torch.int64))
