"""Attention backends: how a model stores this step's K/V and attends over its paged cache, chosen
once per model (pick_attention_backend) from the device, the dtypes and the kernels this machine built.

  triton  CUDA: the Triton store, decode and extend kernels.
  cpu-c   CPU, fp32/bf16 plain caches: cpu_attention.c for every query row (batch-invariant).
  torch   the plain-torch twin: the test oracle, and the CPU path for quantized KV caches, fp16 and
          shapes the C kernel does not take.

Each backend's step path calls its kernels directly: no capability probe runs per step.
"""
from __future__ import annotations

import logging

import torch

from chatserve_kernels import cpu_attention, cpu_ops
from chatserve_kernels.attention import paged_attention_torch, paged_attention_triton
from chatserve_kernels.dispatch import use_triton
from chatserve_kernels.kv_store import store_kv_torch, store_kv_triton
from chatserve_kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)
Cache = tuple[torch.Tensor, ...]       # (k, v) or (k, v, k_scale, v_scale): [num_blocks, block_size, kv_heads, d]


class TorchAttention:
    """The twin: index_copy_ stores, SDPA over gathered blocks. Exact to float tolerance, not batch-invariant."""

    name = "torch"

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: Cache, slots: torch.Tensor, all_valid: bool) -> None:
        # k, v: [T, kv_heads, d]; slots: [T] int64 (-1: skip)
        store_kv_torch(k, v, cache[0], cache[1], slots, *_scales(cache), all_valid=all_valid)

    def attend(self, q: torch.Tensor, cache: Cache, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, q_heads, d] → [T, q_heads, d]; sinks: [q_heads] float32 (gpt-oss)
        ks, vs = _scales(cache)
        return paged_attention_torch(q, cache[0], cache[1], meta, scale, ks, vs, window, logit_softcap=softcap,
                                     sinks=sinks)


class CpuAttention(TorchAttention):
    """cpu_attention.c for every row: decode rows and prefill chunks through one per-row algorithm."""

    name = "cpu-c"

    def __init__(self) -> None:
        self.fn = cpu_attention.c_paged_attention()

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: Cache, slots: torch.Tensor, all_valid: bool) -> None:
        """k, v: [T, kv_heads, d] into the plain cache through cpu_ops' row copy (the decode chain's), else
        the twin's index_copy_; the same bytes either way."""
        if len(cache) == 2 and cpu_ops.store_rows(k, v, cache[0], cache[1], slots):
            return
        super().store(k, v, cache, slots, all_valid)

    def attend(self, q: torch.Tensor, cache: Cache, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        if q.shape[0] and not cpu_attention.run(self.fn, q, cache[0], cache[1], meta, scale, out, window, softcap,
                                                sinks):
            raise RuntimeError("cpu_attention declined a shape it accepted at load")
        return out


class TritonAttention:
    name = "triton"

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: Cache, slots: torch.Tensor, all_valid: bool) -> None:
        store_kv_triton(k, v, cache[0], cache[1], slots, *_scales(cache))

    def attend(self, q: torch.Tensor, cache: Cache, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if softcap or sinks is not None:     # the Triton kernels have neither: those layers run the twin
            return _TWIN.attend(q, cache, meta, scale, window, softcap, sinks)
        ks, vs = _scales(cache)
        return paged_attention_triton(q, cache[0], cache[1], meta, scale, ks, vs, window)


AttentionBackend = TorchAttention | CpuAttention | TritonAttention
_TWIN = TorchAttention()                 # stateless: the Triton backend's fallback for softcap/sink layers


def _scales(cache: Cache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (cache[2], cache[3]) if len(cache) == 4 else (None, None)


def pick_attention_backend(q_dtype: torch.dtype, num_heads: int, cache: Cache, oracle: bool = False
                           ) -> AttentionBackend:
    """The backend for a model whose queries are q_dtype with num_heads heads, over caches shaped like
    `cache` (one layer's). oracle: the torch twin whatever the machine (tests)."""
    k = cache[0]
    if oracle:
        backend: AttentionBackend = TorchAttention()
    elif use_triton(k):
        backend = TritonAttention()
    elif len(cache) == 2 and cpu_attention.available() and cpu_attention.supports(
            torch.empty(1, num_heads, k.shape[3], dtype=q_dtype), k, cache[1]):
        backend = CpuAttention()
    else:
        backend = TorchAttention()
    log.info("attention backend: %s (%s queries, %s cache)", backend.name, str(q_dtype).replace("torch.", ""),
             str(k.dtype).replace("torch.", ""))
    return backend
