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
from dataclasses import dataclass

import torch

from chatserve_kernels import cpu_attention, cpu_ops
from chatserve_kernels.attention import paged_attention_torch, paged_attention_triton
from chatserve_kernels.cpu_extend import extend_attention_flash, flash_supported
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
    """cpu_attention.c for every row: decode rows and prefill chunks through one per-row algorithm.

    flash_rows > 0 (servers without batch invariance only): prompt chunks of at least that many rows go
    through torch's flash kernel instead (oneDNN brgemm: AMX tiles where the CPU has them; a 4,000-token
    layer of the default model in 29 ms on the AMX box, ~5x less than the C kernel by the turn profile).
    A row's bits then depend on the chunk it came in, which is why the batch-invariant default never
    takes it."""

    name = "cpu-c"

    def __init__(self, flash_rows: int = 0) -> None:
        self.fn = cpu_attention.c_paged_attention()
        self.flash_rows = flash_rows
        self._cut: _FlashCut | None = None       # the current step's split (flash_rows > 0)

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: Cache, slots: torch.Tensor, all_valid: bool) -> None:
        """k, v: [T, kv_heads, d] into the plain cache through cpu_ops' row copy (the decode chain's), else
        the twin's index_copy_; the same bytes either way."""
        if len(cache) == 2 and cpu_ops.store_rows(k, v, cache[0], cache[1], slots):
            return
        super().store(k, v, cache, slots, all_valid)

    def attend(self, q: torch.Tensor, cache: Cache, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        if (self.flash_rows and meta.max_query_len >= self.flash_rows and sinks is None
                and flash_supported(q, window, softcap)):
            return self._with_flash(q, cache, meta, scale, window, softcap, out)
        self._c(q, cache, meta, scale, window, softcap, sinks, out)
        return out

    def _c(self, q: torch.Tensor, cache: Cache, meta: AttentionMetadata, scale: float, window: int | None,
           softcap: float | None, sinks: torch.Tensor | None, out: torch.Tensor) -> None:
        if q.shape[0] and not cpu_attention.run(self.fn, q, cache[0], cache[1], meta, scale, out, window, softcap,
                                                sinks):
            raise RuntimeError("cpu_attention declined a shape it accepted at load")

    def _with_flash(self, q: torch.Tensor, cache: Cache, meta: AttentionMetadata, scale: float,
                    window: int | None, softcap: float | None, out: torch.Tensor) -> torch.Tensor:
        # q, out: [T, hq, d]. The long chunks through torch's flash kernel, one by one; every other row
        # through the C kernel, with the step's metadata cut to those sequences once (layers share it).
        if self._cut is None or self._cut.meta is not meta:
            self._cut = _FlashCut.of(meta, cache[0].shape[1], self.flash_rows)
        cut = self._cut
        for rows, seq_len, table in cut.long:
            out[rows] = extend_attention_flash(q[rows], cache[0], cache[1], table, seq_len, scale, *_scales(cache))
        if cut.rest is not None:
            part = torch.empty((cut.rest_rows.shape[0], *q.shape[1:]), dtype=q.dtype)
            self._c(q.index_select(0, cut.rest_rows), cache, cut.rest, scale, window, softcap, None, part)
            out.index_copy_(0, cut.rest_rows, part)
        return out


@dataclass
class _FlashCut:
    """One step split for CpuAttention's flash route: the long chunks (their rows of q, seq_len, block table)
    and the metadata of the sequences left on the C kernel (None if none) with their rows."""

    meta: AttentionMetadata
    long: list[tuple[slice, int, torch.Tensor]]
    rest: AttentionMetadata | None
    rest_rows: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata, bs: int, flash_rows: int) -> "_FlashCut":
        starts = meta.query_start_loc.tolist()
        long, keep = [], []
        for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
            table = meta.block_tables[b, :(sl + bs - 1) // bs]
            if ql >= flash_rows:
                long.append((slice(starts[b], starts[b + 1]), sl, table.long()))
            else:
                keep.append((b, table.tolist()))
        rows = torch.tensor([r for b, _ in keep for r in range(starts[b], starts[b + 1])], dtype=torch.long)
        rest = None if not keep else AttentionMetadata.build(
            [meta.query_lens[b] for b, _ in keep], [meta.seq_lens_list[b] for b, _ in keep], [t for _, t in keep],
            bs, meta.block_tables.device)
        return cls(meta, long, rest, rows)


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


def pick_attention_backend(q_dtype: torch.dtype, num_heads: int, cache: Cache, oracle: bool = False,
                           flash_rows: int = 0) -> AttentionBackend:
    """The backend for a model whose queries are q_dtype with num_heads heads, over caches shaped like
    `cache` (one layer's). oracle: the torch twin whatever the machine (tests); flash_rows: see CpuAttention."""
    k = cache[0]
    if oracle:
        backend: AttentionBackend = TorchAttention()
    elif use_triton(k):
        backend = TritonAttention()
    elif len(cache) == 2 and cpu_attention.available() and cpu_attention.supports(
            torch.empty(1, num_heads, k.shape[3], dtype=q_dtype), k, cache[1]):
        backend = CpuAttention(flash_rows)
    else:
        backend = TorchAttention()
    log.info("attention backend: %s (%s queries, %s cache)", backend.name, str(q_dtype).replace("torch.", ""),
             str(k.dtype).replace("torch.", ""))
    return backend
