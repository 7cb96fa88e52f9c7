"""The CPU attention path's per-step plan: which rows are decode rows, which prefill chunks run as one
padded batch and which one by one, and the index tables and masks they read.

Built by a step's first layer, kept on AttentionMetadata.plans under a typed key and reused by the
other layers. Not a kernel: paged_attention_torch runs the plan.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from chatserve_kernels.decode_attention import decode_prep
from chatserve_kernels.extend_attention import BATCH_MAX_QUERY, SCORE_ELEMS, extend_batch_prep, extend_prep
from chatserve_kernels.metadata import AttentionMetadata


class PlanKey(NamedTuple):
    block_size: int
    sliding_window: int          # 0: none
    batch_short: bool            # short chunks may be batched (plain caches only)


@dataclass
class Chunk:
    """A prefill chunk attended on its own: q rows [start, start + query_len) at the sequence's last
    query_len positions of seq_len."""
    start: int
    query_len: int
    seq_len: int
    table: torch.Tensor                                   # [nblk] int64: the sequence's blocks
    twin_prep: tuple[torch.Tensor, torch.Tensor] | None = None   # extend_prep, built when the twin runs


@dataclass
class DecodeTwin:
    """What the twin needs for the decode rows: their rows in q (None: a decode-only step) and
    decode_prep's (table [B, nblk], mask [B, 1, 1, S])."""
    rows: torch.Tensor | None
    table: torch.Tensor
    mask: torch.Tensor


@dataclass
class StepPlan:
    decode: list[int] | None                  # sequences with one new token
    chunks: list[Chunk]                       # longer chunks attended one by one
    batch: tuple | None                       # extend_batch_prep of the short chunks attended together
    decode_twin: DecodeTwin | None = None     # built only when the twin attends the decode rows


def step_plan(meta: AttentionMetadata, block_size: int, sliding_window: int | None,
              batch_short: bool) -> StepPlan:
    """This step's plan for these caches, built once and then shared by every layer."""
    key = PlanKey(block_size, int(sliding_window or 0), batch_short)
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _build(meta, block_size, sliding_window, batch_short)
    return plan


def _build(meta: AttentionMetadata, block_size: int, sliding_window: int | None,
           batch_short: bool) -> StepPlan:
    """With batch_short, the chunks of <= BATCH_MAX_QUERY tokens are attended together when there are
    two or more and their padded scores stay bounded."""
    decode = [b for b, ql in enumerate(meta.query_lens) if ql == 1] or None
    if meta.is_decode_only:
        return StepPlan(decode, [], None)
    starts = query_starts(meta)
    short = [b for b, ql in enumerate(meta.query_lens) if 1 < ql <= BATCH_MAX_QUERY] if batch_short else []
    batch = None
    if len(short) > 1:
        qls = [meta.query_lens[b] for b in short]
        sls = [meta.seq_lens_list[b] for b in short]
        if len(short) * max(qls) * max(sls) * 64 <= SCORE_ELEMS:   # padded scores bounded (<= 64 q heads)
            batch = extend_batch_prep(meta.block_tables[torch.tensor(short, device=meta.block_tables.device)],
                                      [starts[b] for b in short], qls, sls, block_size, sliding_window)
    batched = set(short) if batch is not None else set()
    chunks = [Chunk(starts[b], ql, sl, meta.block_tables[b, :-(-sl // block_size)].long())
              for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens_list))
              if ql > 1 and b not in batched]
    return StepPlan(decode, chunks, batch)


def query_starts(meta: AttentionMetadata) -> list[int]:
    """Host copy of query_start_loc (no device sync)."""
    return [0, *itertools.accumulate(meta.query_lens)]


def chunk_twin_prep(chunk: Chunk, block_size: int,
                    sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's (table, causal bias [ql, sl]) of a chunk, built at its first use and kept."""
    if chunk.twin_prep is None:
        chunk.twin_prep = extend_prep(chunk.table, chunk.seq_len, chunk.query_len, block_size, sliding_window)
    return chunk.twin_prep


def decode_twin(meta: AttentionMetadata, plan: StepPlan, block_size: int,
                sliding_window: int | None) -> DecodeTwin:
    """The decode rows' gather tables and masks, built only when the twin attends them (the C kernel
    needs neither) and then shared by every layer."""
    if plan.decode_twin is not None:
        return plan.decode_twin
    assert plan.decode is not None
    if meta.is_decode_only:
        rows = None
        table, mask = decode_prep(meta.block_tables, meta.seq_lens, meta.max_seq_len, block_size,
                                  sliding_window)
    else:
        dev = meta.block_tables.device
        starts = query_starts(meta)
        idx = torch.tensor(plan.decode, device=dev)
        rows = torch.tensor([starts[b] for b in plan.decode], device=dev)
        table, mask = decode_prep(meta.block_tables[idx], meta.seq_lens[idx],
                                  max(meta.seq_lens_list[b] for b in plan.decode), block_size, sliding_window)
    plan.decode_twin = DecodeTwin(rows, table, mask)
    return plan.decode_twin
