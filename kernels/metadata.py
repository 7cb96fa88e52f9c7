"""Per-step attention metadata: where each sequence's queries are and which blocks hold its keys.

Built once per step by the model runner and shared by every layer, which also share the CPU path's
typed per-step plans (step_plan.StepPlan) kept on it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chatserve_kernels.step_plan import PlanKey, StepPlan


@dataclass
class AttentionMetadata:
    # Flattened batch of T new tokens from B sequences (no padding):
    #   tokens of seq b are q[query_start_loc[b] : query_start_loc[b+1]]
    #   and sit at positions seq_lens[b] - query_len_b ... seq_lens[b] - 1.
    slot_mapping: torch.Tensor     # [T] int64: block_id * block_size + offset; -1 = don't store
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    query_lens: list[int]          # host copies, so the CPU path never syncs
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    # the CPU attention path's plans (row split, gather tables, masks) per block size / window /
    # cache kind: built by the first layer of a step, reused by the others (step_plan.step_plan)
    plans: dict[PlanKey, StepPlan] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def all_slots_valid(self) -> bool:
        """No -1 in slot_mapping (store_kv then skips its mask); checked once per step, not per layer."""
        return bool((self.slot_mapping >= 0).all())

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """From host lists: slot p of seq b is block_tables[b][p // bs] * bs + p % bs.

        seq b, block_size 4, seq_len 6, query_len 2:
            positions   0 1 2 3 | 4 5
            block_table [7,     | 2  ]   → new tokens at positions 4,5 → slots 2*4+0, 2*4+1
        """
        slots: list[int] = []
        starts = [0]
        for ql, sl, bt in zip(query_lens, seq_lens, block_tables):
            for p in range(sl - ql, sl):
                slots.append(bt[p // block_size] * block_size + p % block_size)
            starts.append(starts[-1] + ql)
        width = max((len(bt) for bt in block_tables), default=1) or 1
        table = [bt + [0] * (width - len(bt)) for bt in block_tables]
        dev = torch.device(device)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev).reshape(len(table), width),
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
