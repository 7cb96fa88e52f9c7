"""Paged attention over a flattened varlen batch: decode tokens and prefill chunks with a cached prefix.

Dispatches: on CUDA, 1-token sequences go to the split-K decode kernel, longer chunks to the extend
kernel (both in one batch when it is mixed); on CPU, decode rows go to a C kernel that reads the blocks
in place (cpu_attention) and chunks to the torch twin. Each new token attends to every cached token of
its sequence and causally to the new tokens before it. The K/V of this step must already be stored.
"""
from __future__ import annotations

import itertools

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
    plain = k_scale is None                            # short chunks are batched for plain caches only
    key = ("torch", bs, sliding_window, plain)
    prep = meta.scratch.get(key)
    if prep is None:
        prep = meta.scratch[key] = _prepare(meta, bs, sliding_window, plain)
    decode, extends, batch = prep
    out = torch.empty_like(q)
    if decode is not None and not (cpu_decode and plain and cpu_attention.decode_attention_cpu(
            q, k_cache, v_cache, meta, scale, out, sliding_window)):
        rows, dprep = _decode_prep(meta, bs, sliding_window, decode)
        if rows is None:                               # a decode-only step
            return decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.max_seq_len, scale, k_scale, v_scale, sliding_window,
                                          prep=dprep)
        out[rows] = decode_attention_torch(q[rows], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                           0, scale, k_scale, v_scale, sliding_window, prep=dprep)
    if batch is not None:
        out[batch[3]] = extend_batch_torch(q, k_cache, v_cache, scale, batch)
    for s, ql, sl, ext in extends:
        out[s:s + ql] = extend_attention_torch(q[s:s + ql], k_cache, v_cache, None, sl, scale,
                                               k_scale, v_scale, sliding_window, prep=ext)
    return out


def _prepare(meta: AttentionMetadata, block_size: int, sliding_window: int | None,
             batch_short: bool) -> tuple:
    """(decode sequences [b] or None, [(start, ql, seq_len, extend prep)] of the chunks attended one by
    one, batch prep or None: with batch_short, the chunks of <= BATCH_MAX_QUERY tokens attended
    together when there are two or more)."""
    decode = [b for b, ql in enumerate(meta.query_lens) if ql == 1] or None
    if meta.is_decode_only:
        return decode, [], None
    starts = _starts(meta)
    short = [b for b, ql in enumerate(meta.query_lens) if 1 < ql <= BATCH_MAX_QUERY] if batch_short else []
    batch = None
    if len(short) > 1:
        qls = [meta.query_lens[b] for b in short]
        sls = [meta.seq_lens_list[b] for b in short]
        if len(short) * max(qls) * max(sls) * 64 <= SCORE_ELEMS:   # padded scores bounded (<= 64 q heads)
            batch = extend_batch_prep(meta.block_tables[torch.tensor(short, device=meta.block_tables.device)],
                                      [starts[b] for b in short], qls, sls, block_size, sliding_window)
    batched = set(short) if batch is not None else set()
    extends = [(starts[b], ql, sl, extend_prep(meta.block_tables[b], sl, ql, block_size, sliding_window))
               for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens_list))
               if ql > 1 and b not in batched]
    return decode, extends, batch


def _starts(meta: AttentionMetadata) -> list[int]:
    """Host copy of query_start_loc (no device sync)."""
    return [0, *itertools.accumulate(meta.query_lens)]


def _decode_prep(meta: AttentionMetadata, block_size: int, sliding_window: int | None,
                 decode: list[int]) -> tuple:
    """(rows of the decode sequences in q, or None for a decode-only step; their decode_prep), built
    only when the twin attends them (the C kernel needs neither) and then shared by every layer."""
    key = ("torch-decode", block_size, sliding_window)
    got = meta.scratch.get(key)
    if got is not None:
        return got
    if meta.is_decode_only:
        got = None, decode_prep(meta.block_tables, meta.seq_lens, meta.max_seq_len, block_size,
                                sliding_window)
    else:
        dev = meta.block_tables.device
        starts = _starts(meta)
        idx = torch.tensor(decode, device=dev)
        got = (torch.tensor([starts[b] for b in decode], device=dev),
               decode_prep(meta.block_tables[idx], meta.seq_lens[idx],
                           max(meta.seq_lens_list[b] for b in decode), block_size, sliding_window))
    meta.scratch[key] = got
    return got


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
