"""Continuous-batching scheduler: decides which tokens of which sequences run in each model step.

It owns the per-step policy over its queues (request_queues.py): the token budget (chunked prefill),
prefix-cache hits at admission, preemption under KV pressure, n > 1 forking and admission control. It
is not the runner: `schedule()` emits a SchedulerOutput, `update()` consumes the RunnerOutput; no torch.
"""
from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from chatserve.config import SchedulerConfig
# AdmissionError is re-exported: callers catch it from here
from chatserve.core.admission import AdmissionError, check_fits, check_group, prefix_in_flight
from chatserve.core.errors import ErrorCode
from chatserve.core.live_request import LiveRequest
from chatserve.core.outputs import (CopyOp, RequestEvent, RunnerOutput, ScheduledSeq, SchedulerOutput,
                                    TokenLogprob)
from chatserve.core.prompt_logprobs import PromptLogprobs
from chatserve.core.request import FinishReason, Request, RequestStatus
from chatserve.core.request_queues import RequestQueues
from chatserve.core.speculator import Speculator
from chatserve.core.step_cost import StepCost

if TYPE_CHECKING:  # the manager is only used through its methods
    from chatserve.core.kv_cache_manager import KVCacheManager

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    """Waiting → running → finished, one `schedule()`/`update()` pair per model step.

    Ordering: every request has a key (priority, arrival_time, admission number); lower keys are
    served first. Both queues are kept sorted by it, so a preempted request re-enters the waiting
    queue ahead of every later arrival of its priority, and the preemption victim is always the
    last running request (lowest priority, latest arrival).

    Per step:
      1. running requests, in key order: decoders get 1 token, requests still prefilling get a chunk
         of what is left of the budget after one token is kept for each later decoder; while any
         request decodes, the step's prompt chunks (admissions included) add at most
         `prefill_tokens_while_decoding` tokens and, while a prompt longer than the budget is in
         progress or next and decoders are at least as many as prompts, at most
         `prefill_time_while_decoding` decode steps' time (StepCost, learned from the runner's
         timings; at least one block of tokens), so a long prompt does not stretch their ITL. If
         `allocate_slots` fails, the chunk shrinks to what fits, else the last running request is
         preempted (repeatedly; finally the request itself).
      2. if nothing was preempted: waiting requests are admitted in key order (head-of-line; never by
         preempting) while the budget, `max_num_seqs` and the KV watermark allow. One exception: a
         request whose prompt starts with >= PREFIX_WAIT_MIN_TOKENS (admission.py) tokens that a
         running request is still prefilling waits until they are cached (later ones may pass it).

    n > 1: the group's sibling 0 (the "leader") prefills prompt[:-1]; at that point siblings 1..n-1
    fork from it (sharing every block), and all n compute the last prompt token themselves (the
    manager copies-on-write the shared partial block) and sample independently. Until the fork the
    siblings are WAITING_FOR_FORK and their sequence slots are reserved. If the leader ends before
    the fork, the next sibling becomes the leader (it finds the committed blocks in the prefix cache).

    Preemption frees everything (recompute, no swap). A CPU swap tier would plug into `_preempt()`
    and the admission path (`_admit`) without changing the contract.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, max_model_len: int) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.config = config
        self.kv = kv
        if config.max_model_len is not None:
            max_model_len = min(max_model_len, config.max_model_len)
        self.max_model_len = max_model_len
        self.num_preemptions = 0

        self._queues = q = RequestQueues()
        # the queues' parts, read on every step: id → request, WAITING / PREEMPTED and RUNNING (each
        # sorted by key), leader id → its siblings WAITING_FOR_FORK
        self._entries, self._waiting, self._running = q.entries, q.waiting, q.running
        self._forks = q.groups.siblings
        self._finished_ids: list[str] = []          # for the next SchedulerOutput
        self._prompt_lps = PromptLogprobs()          # chunk by chunk, until the prompt is computed
        self._counter = itertools.count()
        self._step_id = 0
        # (head request id, free blocks, reserve) of the last failed admission: skip retries until
        # something changes (each try costs an add_seq/free pair and skews prefix-cache stats).
        self._admit_blocked: tuple[str, int, bool] | None = None
        self._t_schedule: float | None = None
        self._tokens_per_s: float | None = None     # EMA, for Retry-After estimates
        self._speculator = Speculator(config, kv)   # speculative decoding (--speculative-ngram)
        self.step_cost = StepCost()                 # what decode steps and prompt chunks take

    # ------------------------------------------------------------------ queries
    @property
    def spec_num_drafts(self) -> int:
        """Sequences verified with drafts (speculative decoding totals, for /metrics)."""
        return self._speculator.num_drafts

    @property
    def spec_num_draft_tokens(self) -> int:
        return self._speculator.num_draft_tokens

    @property
    def spec_num_accepted_tokens(self) -> int:
        return self._speculator.num_accepted_tokens

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._queues.num_waiting

    @property
    def has_unfinished(self) -> bool:
        return bool(self._entries)

    def get_request(self, request_id: str) -> Request | None:
        """The live request, or None once it has finished (or was never added)."""
        e = self._entries.get(request_id)
        return None if e is None else e.req

    def progress(self, request_id: str) -> dict[str, Any] | None:
        """Where a request's prompt stands (queued, prefill, None once it decodes): RequestQueues.progress."""
        return self._queues.progress(request_id)

    # ------------------------------------------------------------------ admission
    def add_request(self, req: Request) -> None:
        self.add_group([req])

    def add_group(self, reqs: list[Request]) -> None:
        """Queue one prompt's n samples, all or none. Raises AdmissionError (400 / 503)."""
        check_group(reqs, self._entries)
        n = len(reqs)
        plen = len(reqs[0].prompt_token_ids)
        check_fits(plen, max(r.params.max_tokens for r in reqs), n, max_model_len=self.max_model_len,
                   block_size=self.kv.block_size, num_blocks=self.kv.num_blocks,
                   max_num_seqs=self.config.max_num_seqs)
        # An empty queue always accepts, so no request is refused forever by a small bound.
        queued = self.num_waiting
        if queued and (queued + n > self.config.max_waiting_requests
                       or self._queues.waiting_tokens + plen > self.config.max_waiting_tokens):
            raise AdmissionError(
                ErrorCode.SERVER_OVERLOADED,
                f"server busy: {queued} requests / {self._queues.waiting_tokens} prompt tokens waiting",
                retry_after=self.retry_after(),
            )
        self._enqueue(reqs)

    def _enqueue(self, reqs: list[Request]) -> None:
        """The group's leader joins the waiting queue; its siblings wait for its fork."""
        base = next(self._counter) * 1024
        entries = []
        for i, r in enumerate(reqs):
            r.max_model_len = self.max_model_len
            r.num_computed_tokens = 0
            r.finish_reason = None
            entries.append(LiveRequest(r, (r.priority, r.arrival_time, base + i), self.max_model_len))
        self._queues.add(entries)
        if reqs[0].params.prompt_logprobs is not None:
            for r in reqs:
                self._prompt_lps.track(r.request_id)

    def retry_after(self) -> float:
        if not self._tokens_per_s:
            return 1.0
        return float(min(60.0, max(1.0, self._queues.waiting_tokens / self._tokens_per_s)))

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """Plan one step: the running requests first, then admissions unless that preempted anyone."""
        self._step_id += 1
        self._t_schedule = now = time.monotonic()
        seqs: list[ScheduledSeq] = []
        copy_ops: list[CopyOp] = []
        budget, prefill_left, preempted = self._schedule_running(seqs, copy_ops, now)
        if not preempted:
            budget = self._admit(seqs, copy_ops, budget, now, prefill_left)

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(self._step_id, seqs, copy_ops, finished,
                               num_batched_tokens=self.config.max_num_batched_tokens - budget)

    def _schedule_running(self, seqs: list[ScheduledSeq], copy_ops: list[CopyOp], now: float
                          ) -> tuple[int, int, bool]:
        """Step 1 of the class docstring: each running request, in key order, gets its decode token
        (and drafts) or a prefill chunk. Returns (the budget left, the prompt tokens admissions may
        still add, -1 if not yet known; whether anything was preempted)."""
        table_of = self.kv.get_block_table
        budget = self.config.max_num_batched_tokens
        running = self._running
        forks = self._forks
        speculator = self._speculator
        preempted = False
        decoders_left = -1   # decoders after the current one; counted at the first prefill chunk
        prefill_left = -1    # prompt tokens the step's chunks may still add; set with decoders_left
        drafting = speculator.drafting(len(running))
        # Preemption only removes from the end of `running`, which list iteration tolerates.
        for e in running:
            if budget <= 0:
                break
            rid = e.rid
            req = e.req
            tokens = e.tokens
            start = req.num_computed_tokens
            rem = len(tokens) - start
            if forks and rid in forks:
                rem -= 1     # a leader stops before the last prompt token; its siblings fork there
            if rem == 1:
                n_new = 1
                if decoders_left > 0:
                    decoders_left -= 1
            else:
                if decoders_left < 0:
                    k = running.index(e)
                    decoders_left = sum(1 for x in running[k + 1:] if self._remaining(x) == 1)
                    prefill_left = self._prefill_allowance(budget, start)
                n_new = min(rem, budget - decoders_left, prefill_left)
                if n_new <= 0:   # the budget is spoken for by later decoders (or the prefill cap)
                    continue
            ops, n_new, decoders_left, preempted_any = self._grant_slots(e, start, n_new, decoders_left)
            preempted = preempted or preempted_any
            end = start + n_new
            if ops is None:   # nothing left to preempt behind it: it yields its own blocks
                self._preempt(e)
                preempted = True
                break
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            seqs.append(ScheduledSeq(rid, tokens[start:end], start, table_of(rid),
                                     end == len(tokens), req.params, req.prompt_token_ids,
                                     req.output_token_ids, e.seed))
            if ops:
                copy_ops.extend(ops)
            budget -= n_new
            if rem != 1:
                prefill_left -= n_new
            if drafting and rem == 1 and not (forks and rid in forks):
                budget -= speculator.add_drafts(e, seqs[-1], copy_ops, budget - max(decoders_left, 0))
        return budget, prefill_left, preempted

    def _grant_slots(self, e: LiveRequest, start: int, n_new: int, decoders_left: int
                     ) -> tuple[list[CopyOp] | None, int, int, bool]:
        """KV slots for e's next n_new tokens: shrink a chunk to what fits, else preempt from the back
        of `running` until they fit. Returns (copy ops, or None when e itself must yield; the tokens
        granted; decoders still behind e; whether anything was preempted)."""
        allocate, running, rid = self.kv.allocate_slots, self._running, e.rid
        ops, granted = allocate(rid, start + n_new), n_new
        preempted = False
        while ops is None:
            if n_new > 1:
                ops, granted = self._shrink_to_fit(rid, start, n_new, reserve=False)
                if ops is not None:
                    break
            victim = running[-1]
            if victim is e:
                break
            if decoders_left > 0 and self._remaining(victim) == 1:
                decoders_left -= 1
            self._preempt(victim)
            preempted = True
            ops, granted = allocate(rid, start + n_new), n_new
        return ops, granted, decoders_left, preempted

    def _prefill_allowance(self, budget: int, start: int = 0) -> int:
        """Prompt tokens one step may compute (its first chunk from position `start`): the budget, but
        while a running request decodes (a long prompt's chunks must not stretch their inter-token
        latency) at most `prefill_tokens_while_decoding`, and what fits in `prefill_time_while_decoding`
        decode steps (at least a block; 0 when the decode estimate is stale: this step times the
        decoders alone) when a prompt longer than a step's budget is being computed or is next in line
        and the decoders are at least as many as the prompts. Prompts within one budget still go in one
        step (one pause for the decoders; slices would each pay a mixed step's fixed part, a read of the
        weights); so do long ones while most requests wait on their prompts (the step's time goes where
        most requests are: slicing then halves the prompts' throughput, docs/benchmarks.md)."""
        cfg = self.config
        cap, share, cost = cfg.prefill_tokens_while_decoding, cfg.prefill_time_while_decoding, self.step_cost
        capped = 0 < cap < budget
        timed = share > 0 and cost.ready
        if not (capped or timed):
            return budget
        decoding, prompts, long = self._phases()
        if not decoding:
            return budget
        allow = cap if capped else budget
        if timed and long and decoding >= prompts:
            if cost.decode_stale:
                return 0            # a decode-only step first, to time what the decoders take now
            assert cost.decode_s is not None
            fits = cost.prompt_tokens_within(share * cost.decode_s, start)
            allow = min(allow, max(fits, self.kv.block_size))
        return allow

    def _phases(self) -> tuple[int, int, bool]:
        """(running requests that decode, requests with prompt tokens to compute (running or waiting),
        whether one of those is longer than a step's budget: running, to its end — its last slice must
        not come back as one long step — or next in the waiting queue)."""
        full = self.config.max_num_batched_tokens
        decoding = prompts = 0
        long = False
        for x in self._running:
            if self._remaining(x) == 1:
                decoding += 1
            else:
                prompts += 1
                long = long or len(x.tokens) > full
        w = self._waiting
        return decoding, prompts + len(w), long or (bool(w) and len(w[0].tokens) > full)

    def _remaining(self, e: LiveRequest) -> int:
        """Tokens e still has to compute before its next sample (or, for a leader, its fork)."""
        rem = len(e.tokens) - e.req.num_computed_tokens
        return rem - 1 if e.rid in self._forks else rem

    def _admit(self, seqs: list[ScheduledSeq], copy_ops: list[CopyOp], budget: int,
               now: float, prefill_left: int = -1) -> int:
        """Admit waiting requests in key order while they fit, their prompt chunks within
        `prefill_left` (-1: not yet known); returns the budget left."""
        kv = self.kv
        max_seqs = self.config.max_num_seqs
        waiting = self._waiting
        if waiting and prefill_left < 0:
            prefill_left = self._prefill_allowance(budget)
        i = 0                # waiting[:i] are deferred behind a running prefill of their prefix
        while i < len(waiting) and budget > 0 and prefill_left > 0:
            e = waiting[i]
            rid = e.rid
            req = e.req
            pending = self._forks.get(rid)
            need_seats = 1 + (len(pending) if pending else 0)
            if len(self._running) + self._queues.reserved_seats() + need_seats > max_seqs:
                break
            reserve = bool(self._running)   # an idle cache never refuses its only request
            free_now = kv.num_free_blocks
            # Its first uncached token always starts a fresh block, so no free block = no entry.
            if free_now == 0 or self._admit_blocked == (rid, free_now, reserve):
                break
            tokens = e.tokens
            if (kv.enable_prefix_caching and rid not in self._prompt_lps
                    and prefix_in_flight(tokens, req.cache_salt, self._running, kv.block_size)):
                i += 1       # it waits for those blocks; a later request may pass it meanwhile
                continue
            # its prompt logprobs need every position's logits: no prefix-cache hit
            cached = kv.add_seq(rid, tokens, req.cache_salt, req.shared_prefix_tokens,
                                match_prefix=rid not in self._prompt_lps)
            target = len(tokens) - 1 if pending else len(tokens)
            n_new = min(target - cached, budget, prefill_left)
            ops = kv.allocate_slots(rid, cached + n_new, reserve_watermark=reserve) if n_new > 0 else []
            if ops is None and n_new > 1:
                ops, n_new = self._shrink_to_fit(rid, cached, n_new, reserve=reserve)
            if ops is None:
                kv.free(rid)
                self._admit_blocked = (rid, free_now, reserve)
                break
            self._admit_blocked = None
            self._queues.pop_waiting(i)
            req.status = _RUNNING
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            self._queues.insert_running(e)
            if n_new > 0:
                seqs.append(self._scheduled(e, cached, n_new, now))
                copy_ops.extend(ops)
                budget -= n_new
                prefill_left -= n_new
            else:
                budget = self._fork_at_admission(e, seqs, copy_ops, budget, now, reserve)
        return budget

    def _fork_at_admission(self, leader: LiveRequest, seqs: list[ScheduledSeq], copy_ops: list[CopyOp],
                           budget: int, now: float, reserve: bool) -> int:
        """The leader's prompt[:-1] is all cached (or empty): fork now, and let each of the n compute
        the last prompt token if there is room (else next step, as running work). Returns the budget left."""
        kv = self.kv
        max_seqs = self.config.max_num_seqs
        for x in [leader, *self._fork(leader)]:
            if budget <= 0 or len(seqs) >= max_seqs:
                break
            start = x.req.num_computed_tokens
            ops = kv.allocate_slots(x.rid, start + 1, reserve_watermark=reserve)
            if ops is None:
                break
            seqs.append(self._scheduled(x, start, 1, now))
            copy_ops.extend(ops)
            budget -= 1
        return budget

    def _shrink_to_fit(self, rid: str, start: int, n_new: int, *, reserve: bool
                       ) -> tuple[list[CopyOp] | None, int]:
        """After n_new tokens from `start` did not fit: slots for the largest k < n_new that does
        (binary search), as (copy ops, k), or (None, 0) when not even one token fits."""
        kv = self.kv
        lo, hi = 0, n_new - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kv.can_allocate(rid, start + mid, reserve_watermark=reserve):
                lo = mid
            else:
                hi = mid - 1
        ops = kv.allocate_slots(rid, start + lo, reserve_watermark=reserve) if lo else None
        return (ops, lo) if ops is not None else (None, 0)

    def _scheduled(self, e: LiveRequest, start: int, n_new: int, now: float) -> ScheduledSeq:
        req = e.req
        end = start + n_new
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        return ScheduledSeq(e.rid, e.tokens[start:end], start, self.kv.get_block_table(e.rid),
                            end == len(e.tokens), req.params, req.prompt_token_ids, req.output_token_ids,
                            e.seed)

    def _fork(self, leader: LiveRequest) -> list[LiveRequest]:
        """Siblings of `leader` start sharing its blocks (it has computed prompt[:-1])."""
        sibs = self._queues.groups.release(leader.rid)
        lreq = leader.req
        for s in sibs:
            self._prompt_lps.drop(s.rid)          # the leader computed (and reports) the prompt
            self.kv.fork(leader.rid, s.rid)
            s.req.status = _RUNNING
            s.req.num_computed_tokens = lreq.num_computed_tokens
            s.req.num_cached_tokens = lreq.num_cached_tokens
            self._queues.insert_running(s)
        return sibs

    def _preempt(self, e: LiveRequest) -> None:
        """Free all of e's blocks and requeue it; it recomputes prompt + outputs later."""
        self.kv.free(e.rid)
        self._queues.remove_running(e)
        req = e.req
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._queues.insert_waiting(e)

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput, res: RunnerOutput) -> list[RequestEvent]:
        """Apply one step's results: commit computed tokens, append samples, stop and free."""
        if res.step_id != out.step_id:
            raise ValueError(f"runner output for step {res.step_id}, expected {out.step_id}")
        self._measure_rate(out)
        if res.elapsed_s is not None:
            self.step_cost.observe(out, res.elapsed_s)
        commit = self.kv.commit
        entries = self._entries
        prompt_lps = self._prompt_lps if len(self._prompt_lps) else None   # (none are added meanwhile)
        errors = res.errors
        sampled = res.sampled
        logprobs = res.logprobs
        events: list[RequestEvent] = []
        for seq in out.seqs:
            rid = seq.request_id
            e = entries.get(rid)
            if e is None:
                continue   # finished (aborted) since schedule()
            req = e.req
            if req.status is not _RUNNING:
                continue
            if errors and rid in errors:
                events.append(self._finish(e, FinishReason.ERROR, errors[rid]))
                continue
            if seq.draft_token_ids:
                events.append(self._update_drafted(e, seq, res))
                continue
            tokens = e.tokens
            computed = seq.start_pos + len(seq.token_ids)
            req.num_computed_tokens = computed
            commit(rid, tokens, computed)
            plp = None if prompt_lps is None else prompt_lps.gather(seq, res, computed)
            if not seq.sample:
                ev = self._update_chunk(e, computed, plp)
                if ev is not None:
                    events.append(ev)
                continue
            if len(tokens) >= e.limit:     # max_tokens 0: the prompt (and its logprobs) only
                ev = self._finish(e, FinishReason.LENGTH)
                ev.prompt_logprobs = plp
                events.append(ev)
                continue
            tok = sampled.get(rid)
            if tok is None:
                events.append(self._finish(e, FinishReason.ERROR, "the runner returned no token"))
                continue
            reason = e.append(tok)
            if reason is None:
                ev = RequestEvent(rid, [tok], [], False, None, len(req.prompt_token_ids),
                                  req.num_cached_tokens)
            else:
                ev = self._finish(e, reason)
                ev.new_token_ids = [tok]
            if logprobs:
                lp = logprobs.get(rid)
                if lp is not None:
                    ev.logprobs = [lp]
            if plp is not None:
                ev.prompt_logprobs = plp
            events.append(ev)
        return events

    def _measure_rate(self, out: SchedulerOutput) -> None:
        """Fold this step's tokens per second (schedule() to update()) into the EMA behind Retry-After."""
        if self._t_schedule is None or not out.num_batched_tokens:
            return
        dt = time.monotonic() - self._t_schedule
        if dt > 0:
            tps = out.num_batched_tokens / dt
            self._tokens_per_s = tps if self._tokens_per_s is None else (0.9 * self._tokens_per_s + 0.1 * tps)

    def _update_chunk(self, e: LiveRequest, computed: int, plp: list[TokenLogprob] | None
                      ) -> RequestEvent | None:
        """A computed prompt chunk that samples nothing: a leader that has computed prompt[:-1] forks
        its siblings; an event only to hand over the whole prompt's logprobs."""
        forks = self._forks
        if forks and e.rid in forks and computed == len(e.tokens) - 1:
            self._fork(e)
        if plp is None:
            return None
        req = e.req
        return RequestEvent(e.rid, num_prompt_tokens=len(req.prompt_token_ids),
                            num_cached_tokens=req.num_cached_tokens, prompt_logprobs=plp)

    def _update_drafted(self, e: LiveRequest, seq: ScheduledSeq, res: RunnerOutput) -> RequestEvent:
        """A verified speculative step: the accepted run (Speculator.apply), as one event."""
        applied = self._speculator.apply(e, seq, res)
        if applied is None:
            return self._finish(e, FinishReason.ERROR, "the runner returned no valid tokens for the drafts")
        emitted, reason = applied
        if reason is None:
            req = e.req
            ev = RequestEvent(e.rid, emitted, [], False, None, len(req.prompt_token_ids), req.num_cached_tokens)
        else:
            ev = self._finish(e, reason)
            ev.new_token_ids = emitted
        lp = res.logprobs.get(e.rid) if len(emitted) == 1 else None
        if lp is not None:
            ev.logprobs = [lp]
        return ev

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestEvent | None:
        """End one request now (abort, stop string): its blocks are freed in this call.

        Returns its final event, or None if it is unknown or already finished. Siblings live on.
        """
        e = self._entries.get(request_id)
        if e is None:
            return None
        return self._finish(e, reason)

    def _finish(self, e: LiveRequest, reason: FinishReason, error: str | None = None) -> RequestEvent:
        """End e wherever it is (running, waiting, waiting for a fork): free its blocks, its final event."""
        rid = e.rid
        req = e.req
        if req.status is _RUNNING:
            self.kv.free(rid, keep_warm=req.keep_warm)
        self._queues.remove(e)
        if self._admit_blocked is not None and self._admit_blocked[0] == rid:
            self._admit_blocked = None
        self._prompt_lps.drop(rid)

        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.first_scheduled_time is not None:
            self._finished_ids.append(rid)
        return RequestEvent(rid, finished=True, finish_reason=reason, error=error,
                            num_prompt_tokens=len(req.prompt_token_ids),
                            num_cached_tokens=max(0, req.num_cached_tokens))
