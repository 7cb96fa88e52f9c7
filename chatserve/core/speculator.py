"""Speculator: the scheduler's side of speculative decoding (`--speculative-ngram`): which steps draft,
prompt-lookup drafts added to decode rows, and a verified run applied with the draft/accept totals.

Bookkeeping only: the drafts come from NgramProposer and the runner verifies them (RunnerOutput.accepted).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from chatserve.config import SchedulerConfig
from chatserve.core.ngram_proposer import NgramProposer, can_draft
from chatserve.core.outputs import CopyOp, RunnerOutput, ScheduledSeq
from chatserve.core.request import FinishReason

if TYPE_CHECKING:  # both are used only through their attributes and methods
    from chatserve.core.kv_cache_manager import KVCacheManager
    from chatserve.core.live_request import LiveRequest


class Speculator:
    """Drafts for decode rows and their verified runs; totals for /metrics (all 0 while it is off)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.kv = kv
        self._proposer = NgramProposer(config.num_speculative_tokens, config.ngram_prompt_lookup_max,
                                       config.ngram_prompt_lookup_min) if config.speculative_ngram else None
        self._max_batch = config.speculative_disable_by_batch_size
        self.num_drafts = 0             # sequences verified with drafts
        self.num_draft_tokens = 0       # draft tokens verified
        self.num_accepted_tokens = 0    # draft tokens the model agreed with

    def drafting(self, num_running: int) -> bool:
        """Whether this step drafts: speculation is on and few enough sequences run that the drafts'
        extra tokens cost less than the steps they save (docs/speculative.md, docs/benchmarks.md)."""
        return self._proposer is not None and num_running <= self._max_batch

    def add_drafts(self, e: LiveRequest, seq: ScheduledSeq, copy_ops: list[CopyOp], room: int) -> int:
        """Extend e's decode `seq` by prompt-lookup drafts, if its sampling allows them, they fit in
        `room` budget tokens and their KV slots are free without preempting anyone (and above the
        watermark). Returns the number of drafts added."""
        req = e.req
        tokens = e.tokens
        # Never draft past max_tokens / the context: k drafts + the bonus token must fit under the limit.
        room = min(room, e.limit - len(tokens) - 1)
        if room <= 0 or not can_draft(req.params, len(req.output_token_ids)):
            return 0
        assert self._proposer is not None
        drafts = self._proposer.propose(tokens, room)
        if not drafts:
            return 0
        ops = self.kv.allocate_slots(e.rid, len(tokens) + len(drafts), reserve_watermark=True)
        if ops is None:
            return 0
        copy_ops.extend(ops)
        seq.token_ids = seq.token_ids + drafts
        seq.block_table = self.kv.get_block_table(e.rid)
        seq.draft_token_ids = drafts
        return len(drafts)

    def apply(self, e: LiveRequest, seq: ScheduledSeq, res: RunnerOutput
              ) -> tuple[list[int], FinishReason | None] | None:
        """Apply a verified drafted step: append the accepted tokens one by one under the stop rules
        (nothing past a stop or the length limit is kept), commit only their K/V and, unless the run
        ends the request, give back the slots granted to rejected drafts. Returns (the tokens
        emitted, the finish reason or None), or None when the runner's tokens do not verify the drafts."""
        rid = e.rid
        drafts = seq.draft_token_ids
        got = res.accepted.get(rid)
        if got is None and rid in res.sampled:
            got = [res.sampled[rid]]           # a runner that did not verify: the plain next token
        if not got or len(got) > len(drafts) + 1 or got[:-1] != drafts[:len(got) - 1]:
            return None
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(got) - 1
        emitted: list[int] = []
        reason = None
        for tok in got:
            emitted.append(tok)
            reason = e.append(tok)
            if reason is not None:
                break
        # K/V hold the last token and the accepted drafts; the last emitted token has none yet.
        computed = seq.start_pos + len(emitted)
        e.req.num_computed_tokens = computed
        self.kv.commit(rid, e.tokens, computed)
        if reason is None:
            self.kv.trim(rid, len(e.tokens))
        return emitted, reason
