"""Paged attention over a flattened varlen batch: decode tokens and prefill chunks with a cached prefix.

Dispatches per call (tests, benchmarks; a model picks its attention_backend once instead): on CUDA,
1-token sequences go to the split-K decode kernel, longer chunks to the extend kernel (both in one
batch when it is mixed); on CPU every row goes to the C kernel that reads the blocks in place
(cpu_attention) where it takes the tensors, else to the torch twin (decode rows batched, long chunks
through torch's tiled flash kernel with cpu_extend). Each new token attends to every cached token of
its sequence and causally to the new tokens before it. The K/V of this step must already be stored.
"""
from __future__ import annotations

import torch

from chatserve_kernels import cpu_attention
from chatserve_kernels.cpu_extend import extend_attention_flash, flash_supported
from chatserve_kernels.decode_attention import decode_attention_torch, decode_attention_triton
from chatserve_kernels.dispatch import use_triton
from chatserve_kernels.extend_attention import (extend_attention_torch, extend_attention_triton,
                                                extend_batch_torch)
from chatserve_kernels.metadata import AttentionMetadata
from chatserve_kernels.step_plan import chunk_twin_prep, decode_twin, step_plan


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          sliding_window: int | None = None, cpu_decode: bool = False,
                          logit_softcap: float | None = None, cpu_extend: bool = False) -> torch.Tensor:
    # q: [T, q_heads, head_dim] → out: [T, q_heads, head_dim]
    # cpu_decode: every row through the C kernel when it takes them (cpu_attention); cpu_extend:
    # otherwise chunks attended one by one through torch's CPU flash kernel when it takes them.
    # Both False, the default, is the pure-torch twin (the test oracle).
    # Decode rows run batched in one SDPA call; chunks of <= BATCH_MAX_QUERY tokens run as one padded
    # batch, longer ones one by one (GEMMs, no per-token loop).
    # Index tables and masks are built once per step (step_plan) and shared by every layer.
    bs = k_cache.shape[1]
    plain = k_scale is None                            # short chunks are batched for plain caches only
    out = torch.empty_like(q)
    if cpu_decode and plain and cpu_attention.paged_attention_cpu(q, k_cache, v_cache, meta, scale, out,
                                                                  sliding_window, logit_softcap):
        return out
    plan = step_plan(meta, bs, sliding_window, plain)
    if plan.decode is not None:
        dt = decode_twin(meta, plan, bs, sliding_window)
        prep = (dt.table, dt.mask)
        if dt.rows is None:                            # a decode-only step
            return decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.max_seq_len, scale, k_scale, v_scale, sliding_window,
                                          prep=prep, logit_softcap=logit_softcap)
        out[dt.rows] = decode_attention_torch(q[dt.rows], k_cache, v_cache, meta.block_tables,
                                              meta.seq_lens, 0, scale, k_scale, v_scale, sliding_window,
                                              prep=prep, logit_softcap=logit_softcap)
    if plan.batch is not None:
        out[plan.batch[3]] = extend_batch_torch(q, k_cache, v_cache, scale, plan.batch, logit_softcap)
    flash = cpu_extend and flash_supported(q, sliding_window, logit_softcap)
    for c in plan.chunks:
        rows = slice(c.start, c.start + c.query_len)
        if flash:
            out[rows] = extend_attention_flash(q[rows], k_cache, v_cache, c.table, c.seq_len, scale,
                                               k_scale, v_scale)
        else:
            out[rows] = extend_attention_torch(q[rows], k_cache, v_cache, None, c.seq_len, scale, k_scale,
                                               v_scale, sliding_window,
                                               prep=chunk_twin_prep(c, bs, sliding_window),
                                               logit_softcap=logit_softcap)
    return out


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
                                sliding_window, skip_decode=n_decode > 0, max_seq_len=meta.max_seq_len)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                    num_splits: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v for every new token against its sequence's paged K/V.

    q: [T, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim];
    k_scale, v_scale: the scales of an int8/fp8 cache (quant.allocate_kv_cache); sliding_window: a
    token sees the last `sliding_window` positions (itself included), per call so per layer;
    num_splits: force the decode split; logit_softcap: scores s become c·tanh(s / c) (Gemma 2), on
    the torch twin on every device.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    assert q.shape[0] == sum(meta.query_lens), (q.shape, meta.query_lens)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if use_triton(q) and not logit_softcap:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window,
                                      num_splits)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window,
                                 cpu_decode=True, logit_softcap=logit_softcap, cpu_extend=True)
