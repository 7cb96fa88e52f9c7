"""Paged attention over a flattened varlen batch: decode tokens and prefill chunks with a cached prefix.

Each new token attends to every cached token of its sequence and causally to the new tokens before it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from chatserve_kernels.metadata import AttentionMetadata


def _gather_kv(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, head_dim]; table: [n_blocks] → [seq_len, kv_heads, head_dim]
    bs = cache.shape[1]
    nblk = (seq_len + bs - 1) // bs
    return cache.index_select(0, table[:nblk].long()).flatten(0, 1)[:seq_len]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # q: [T, q_heads, head_dim] → out: [T, q_heads, head_dim]
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if meta.is_decode_only:
        return _decode_batched(q, k_cache, v_cache, meta, scale)
    start = 0
    for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
        qb = q[start:start + ql].transpose(0, 1)                      # [hq, ql, d]
        kb = _gather_kv(k_cache, meta.block_tables[b], sl).transpose(0, 1).to(q.dtype)  # [hkv, sl, d]
        vb = _gather_kv(v_cache, meta.block_tables[b], sl).transpose(0, 1).to(q.dtype)
        if ql == 1:
            mask = None
        else:
            # query i sits at position sl - ql + i and sees keys 0 .. sl - ql + i
            qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
            mask = torch.arange(sl, device=q.device)[None, :] <= qpos     # [ql, sl]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                            enable_gqa=hq != hkv)
        out[start:start + ql] = ob.transpose(0, 1)
        start += ql
    return out


def _decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # One query per sequence: gather every sequence's blocks padded to the longest, mask the tail.
    B, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    nblk = (meta.max_seq_len + bs - 1) // bs
    table = meta.block_tables[:, :nblk].long()                          # [B, nblk]
    k = k_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)        # [B, hkv, nblk*bs, d]
    v = v_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
    pos = torch.arange(nblk * bs, device=q.device)
    mask = (pos[None, :] < meta.seq_lens[:, None].to(pos.dtype))[:, None, None, :]  # [B, 1, 1, S]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=hq != hkv)          # [B, hq, 1, d]
    return out[:, :, 0, :]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for every new token against its sequence's paged K/V.

    q: [T, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim].
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    assert q.shape[0] == sum(meta.query_lens), (q.shape, meta.query_lens)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale)
