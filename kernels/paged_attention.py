"""Paged attention over a flattened varlen batch: decode tokens and prefill chunks with a cached prefix.

Dispatches: on CUDA, 1-token sequences go to the split-K decode kernel, longer chunks to the extend
kernel (both in one batch when it is mixed); on CPU, decode rows go to a C kernel that reads the blocks
in place (cpu_attention) and chunks to the torch twin. Each new token attends to every cached token of
its sequence and causally to the new tokens before it. The K/V of this step must already be stored.
"""
from __future__ import annotations

import torch

from chatserve_kernels import cpu_attention
from chatserve_kernels.decode_attention import decode_attention_torch, decode_attention_triton, decode_prep
from chatserve_kernels.dispatch import use_triton
from chatserve_kernels.extend_attention import (BATCH_MAX_QUERY, SCORE_ELEMS, extend_attention_torch,
                                                extend_attention_triton, extend_batch_prep,
                                                extend_batch_torch, extend_prep)
from chatserve_kernels.metadata import AttentionMetadata


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          sliding_window: int | None = None, cpu_decode: bool = False) -> torch.Tensor:
    # q: [T, q_heads, head_dim] → out: [T, q_heads, head_dim]
    # cpu_decode: decode rows through the C kernel when it takes them (cpu_attention); the default,
    # False, is the pure-torch twin (the test oracle)
    # Decode rows run batched in one SDPA call; chunks of <= BATCH_MAX_QUERY tokens run as one padded
    # batch, longer ones one by one (GEMMs, no per-token loop).
    # Index tables and masks are built once per step (meta.scratch) and shared by every layer.
    bs = k_cache.shape[1]
    key = ("torch", bs, sliding_window)
    prep = meta.scratch.get(key)
    if prep is None:
        prep = meta.scratch[key] = _prepare(meta, bs, sliding_window)
    dprep, rows, extends, batch = prep
    out = torch.empty_like(q)
    fast = (cpu_decode and k_scale is None and dprep is not None
            and cpu_attention.decode_attention_cpu(q, k_cache, v_cache, meta, scale, out, sliding_window))
    if meta.is_decode_only:
        if fast:
            return out
        return decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, scale, k_scale, v_scale, sliding_window,
                                      prep=dprep)
    if dprep is not None and not fast:     # the tables below are unused once prep is given
        out[rows] = decode_attention_torch(q[rows], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                           0, scale, k_scale, v_scale, sliding_window, prep=dprep)
    batched = batch is not None and k_scale is None
    if batched:
        out[batch[3]] = extend_batch_torch(q, k_cache, v_cache, scale, batch)
    for s, ql, sl, ext in extends:
        if not (batched and ql <= BATCH_MAX_QUERY):
            out[s:s + ql] = extend_attention_torch(q[s:s + ql], k_cache, v_cache, None, sl, scale,
                                                   k_scale, v_scale, sliding_window, prep=ext)
    return out


def _prepare(meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> tuple:
    """(decode prep or None, decode rows, [(start, ql, seq_len, extend prep)], batch prep or None:
    the short chunks attended together when there are two or more)."""
    if meta.is_decode_only:
        return (decode_prep(meta.block_tables, meta.seq_lens, meta.max_seq_len, block_size,
                            sliding_window), None, [], None)
    starts = [0]                                       # host copy of query_start_loc (no device sync)
    for ql in meta.query_lens:
        starts.append(starts[-1] + ql)
    dev = meta.block_tables.device
    decode = [b for b, ql in enumerate(meta.query_lens) if ql == 1]
    dprep = rows = None
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=dev)
        idx = torch.tensor(decode, device=dev)
        dprep = decode_prep(meta.block_tables[idx], meta.seq_lens[idx],
                            max(meta.seq_lens_list[b] for b in decode), block_size, sliding_window)
    extends = [(starts[b], ql, sl, extend_prep(meta.block_tables[b], sl, ql, block_size, sliding_window))
               for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens_list)) if ql > 1]
    short = [b for b, ql in enumerate(meta.query_lens) if 1 < ql <= BATCH_MAX_QUERY]
    batch = None
    if len(short) > 1:
        qls = [meta.query_lens[b] for b in short]
        sls = [meta.seq_lens_list[b] for b in short]
        if len(short) * max(qls) * max(sls) * 64 <= SCORE_ELEMS:   # padded scores bounded (<= 64 q heads)
            batch = extend_batch_prep(meta.block_tables[torch.tensor(short, device=dev)],
                                      [starts[b] for b in short], qls, sls, block_size, sliding_window)
    return dprep, rows, extends, batch


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    # q: [T, q_heads, head_dim] → out: [T, q_heads, head_dim]; both kernels write disjoint rows of out.
    out = torch.empty_like(q)
    n_decode = sum(1 for ql in meta.query_lens if ql == 1)
    if n_decode:
        decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.max_seq_len, scale, out, k_scale, v_scale,
                                sliding_window, num_splits)
    if n_decode < meta.num_seqs:
        extend_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.max_query_len, scale, out, k_scale, v_scale,
                                sliding_window, skip_decode=n_decode > 0)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for every new token against its sequence's paged K/V.

    q: [T, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim];
    k_scale, v_scale: the scales of an int8/fp8 cache (quant.allocate_kv_cache); sliding_window: a
    token sees the last `sliding_window` positions (itself included); num_splits: force the decode split.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    assert q.shape[0] == sum(meta.query_lens), (q.shape, meta.query_lens)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window,
                                      num_splits)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window,
                                 cpu_decode=True)
