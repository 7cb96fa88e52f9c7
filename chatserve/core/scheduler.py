"""Continuous-batching scheduler: decides which tokens of which sequences run in each model step.

It owns the waiting/running queues, the per-step token budget (chunked prefill), prefix-cache hits at
admission, preemption under KV pressure, n > 1 forking and admission control. It is not the runner:
`schedule()` emits a SchedulerOutput, `update()` consumes the RunnerOutput; pure Python, no torch.
"""
from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING

from chatserve.config import SchedulerConfig
from chatserve.core.outputs import (
    CopyOp,
    RequestEvent,
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from chatserve.core.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:  # the manager is only used through its methods
    from chatserve.core.kv_cache_manager import KVCacheManager

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_FORK = RequestStatus.WAITING_FOR_FORK


class AdmissionError(Exception):
    """A request refused at the door.

    status 400: it can never fit (context length, whole KV cache, more samples than sequence slots).
    status 503: the waiting queue is full; retry after `retry_after` seconds.
    """

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class Scheduler:
    """Waiting → running → finished, one `schedule()`/`update()` pair per model step.

    Ordering: every request has a key (priority, arrival_time, admission number); lower keys are
    served first. Both queues are kept sorted by it, so a preempted request re-enters the waiting
    queue ahead of every later arrival of its priority, and the preemption victim is always the
    last running request (lowest priority, latest arrival).

    Per step:
      1. running requests, in key order: decoders get 1 token, requests still prefilling get a chunk
         of what is left of the budget after one token is reserved for each later decoder. If
         `allocate_slots` fails, the chunk shrinks to what fits, else the last running request is
         preempted (repeatedly; finally the request itself).
      2. if nothing was preempted: waiting requests are admitted in key order (head-of-line; never by
         preempting) while the budget, `max_num_seqs` and the KV watermark allow.

    n > 1: the group's sibling 0 (the "leader") prefills prompt[:-1]; at that point siblings 1..n-1
    fork from it (sharing every block), and all n compute the last prompt token themselves (the
    manager copies-on-write the shared partial block) and sample independently. Until the fork the
    siblings are WAITING_FOR_FORK and their sequence slots are reserved. If the leader ends before
    the fork, the next sibling becomes the leader (it finds the committed blocks in the prefix cache).

    Preemption frees everything (recompute, no swap). A CPU swap tier would plug into `_preempt()`
    and the admission path (`_admit_one`) without changing the contract.
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

        self._requests: dict[str, Request] = {}     # every unfinished request (any status)
        self._tokens: dict[str, list[int]] = {}     # prompt + outputs, appended in place (no copies)
        self._keys: dict[str, tuple[int, float, int]] = {}
        self._waiting: list[Request] = []           # WAITING / PREEMPTED, sorted by key
        self._running: list[Request] = []           # RUNNING, sorted by key
        self._forks: dict[str, list[Request]] = {}  # leader id → siblings WAITING_FOR_FORK
        self._leader_of: dict[str, str] = {}        # sibling id → leader id (while waiting for fork)
        self._num_pending = 0                       # siblings waiting for fork
        self._waiting_tokens = 0                    # tokens to compute for the waiting queue
        self._finished_ids: list[str] = []          # for the next SchedulerOutput
        self._counter = itertools.count()
        self._step_id = 0
        # (head request id, free blocks, reserve) of the last failed admission: skip retries until
        # something changes (each try costs an add_seq/free pair and skews prefix-cache stats).
        self._admit_blocked: tuple[str, int, bool] | None = None
        self._t_schedule: float | None = None
        self._tokens_per_s: float | None = None     # EMA, for Retry-After estimates

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + self._num_pending

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The live request, or None once it has finished (or was never added)."""
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ admission
    def add_request(self, req: Request) -> None:
        self.add_group([req])

    def add_group(self, reqs: list[Request]) -> None:
        """Queue one prompt's n samples, all or none. Raises AdmissionError (400 / 503)."""
        if not reqs:
            raise ValueError("empty group")
        leader = reqs[0]
        prompt = leader.prompt_token_ids
        n = len(reqs)
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != n or any(i in self._requests for i in ids):
            raise ValueError(f"duplicate request id in {ids}")
        if n > 1:
            gid = leader.group_id
            for i, r in enumerate(reqs):
                if r.group_id is None or r.group_id != gid or r.sample_index != i:
                    raise ValueError("siblings need one group_id and sample_index 0..n-1")
                if r.prompt_token_ids != prompt:
                    raise ValueError("siblings must share the prompt")

        plen = len(prompt)
        if plen == 0:
            raise AdmissionError(400, "the prompt is empty")
        max_tokens = max(r.params.max_tokens for r in reqs)
        if plen + max_tokens > self.max_model_len:
            raise AdmissionError(
                400,
                f"prompt ({plen} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"({self.max_model_len} tokens)",
            )
        bs = self.kv.block_size
        need_blocks = -(-(plen + max_tokens) // bs)
        if need_blocks > self.kv.num_blocks:
            raise AdmissionError(
                400,
                f"prompt + max_tokens needs {need_blocks} KV blocks, the whole cache has "
                f"{self.kv.num_blocks}",
            )
        if n > self.config.max_num_seqs:
            raise AdmissionError(400, f"n={n} exceeds max_num_seqs={self.config.max_num_seqs}")

        # An empty queue always accepts, so no request is refused forever by a small bound.
        queued = self.num_waiting
        if queued and (queued + n > self.config.max_waiting_requests
                       or self._waiting_tokens + plen > self.config.max_waiting_tokens):
            raise AdmissionError(
                503,
                f"server busy: {queued} requests / {self._waiting_tokens} prompt tokens waiting",
                retry_after=self._retry_after(),
            )

        base = next(self._counter)
        for i, r in enumerate(reqs):
            rid = r.request_id
            r.max_model_len = self.max_model_len
            r.num_computed_tokens = 0
            r.finish_reason = None
            self._requests[rid] = r
            self._tokens[rid] = list(r.prompt_token_ids) + list(r.output_token_ids)
            self._keys[rid] = (r.priority, r.arrival_time, base * 1024 + i)
            if i == 0:
                r.status = _WAITING
                self._insert_waiting(r)
            else:
                r.status = _FORK
                self._leader_of[rid] = leader.request_id
        if n > 1:
            self._forks[leader.request_id] = list(reqs[1:])
            self._num_pending += n - 1

    def _retry_after(self) -> float:
        if not self._tokens_per_s:
            return 1.0
        return float(min(60.0, max(1.0, self._waiting_tokens / self._tokens_per_s)))

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        self._t_schedule = time.monotonic()
        kv = self.kv
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        copy_ops: list[CopyOp] = []
        running = self._running
        forks = self._forks
        tokens_of = self._tokens

        # Tokens left per running request; count decoders so prefill chunks leave them 1 token each.
        remaining: dict[str, int] = {}
        decoders_left = 0
        for r in running:
            rid = r.request_id
            target = len(tokens_of[rid]) - 1 if rid in forks else len(tokens_of[rid])
            rem = target - r.num_computed_tokens
            remaining[rid] = rem
            if rem == 1:
                decoders_left += 1

        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            rid = req.request_id
            rem = remaining[rid]
            if rem == 1:
                decoders_left -= 1
                n_new = 1
            else:
                n_new = min(rem, budget - decoders_left)
                if n_new <= 0:   # the budget is spoken for by later decoders
                    i += 1
                    continue
            start = req.num_computed_tokens
            ops = kv.allocate_slots(rid, start + n_new)
            while ops is None:
                if n_new > 1:
                    fit = self._largest_fit(rid, start, n_new, reserve=False)
                    if fit:
                        n_new = fit
                        ops = kv.allocate_slots(rid, start + n_new)
                        break
                if len(running) - 1 <= i:
                    break
                victim = running[-1]
                if remaining[victim.request_id] == 1:
                    decoders_left -= 1
                self._preempt(victim)
                preempted = True
                ops = kv.allocate_slots(rid, start + n_new)
            if ops is None:   # nothing left to preempt behind it: it yields its own blocks
                self._preempt(req)
                preempted = True
                break
            seqs.append(self._scheduled(req, start, n_new))
            if ops:
                copy_ops.extend(ops)
            budget -= n_new
            i += 1

        if not preempted:
            budget = self._admit(seqs, copy_ops, budget)

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            step_id=self._step_id,
            seqs=seqs,
            copy_ops=copy_ops,
            finished_ids=finished,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def _admit(self, seqs: list[ScheduledSeq], copy_ops: list[CopyOp], budget: int) -> int:
        """Admit waiting requests in key order while they fit; returns the budget left."""
        kv = self.kv
        max_seqs = self.config.max_num_seqs
        waiting = self._waiting
        while waiting and budget > 0:
            req = waiting[0]
            rid = req.request_id
            pending = self._forks.get(rid)
            need_seats = 1 + (len(pending) if pending else 0)
            if len(self._running) + self._reserved_seats() + need_seats > max_seqs:
                break
            reserve = bool(self._running)   # an idle cache never refuses its only request
            free_now = kv.num_free_blocks
            if self._admit_blocked == (rid, free_now, reserve):
                break
            tokens = self._tokens[rid]
            cached = kv.add_seq(rid, tokens, req.cache_salt)
            target = len(tokens) - 1 if pending else len(tokens)
            n_new = min(target - cached, budget)
            ops: list[CopyOp] | None = []
            if n_new > 0:
                ops = kv.allocate_slots(rid, cached + n_new, reserve_watermark=reserve)
                if ops is None and n_new > 1:
                    fit = self._largest_fit(rid, cached, n_new, reserve=reserve)
                    if fit:
                        n_new = fit
                        ops = kv.allocate_slots(rid, cached + n_new, reserve_watermark=reserve)
                if ops is None:
                    kv.free(rid)
                    self._admit_blocked = (rid, free_now, reserve)
                    break
            self._admit_blocked = None
            waiting.pop(0)
            self._waiting_tokens -= len(tokens)
            req.status = _RUNNING
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            self._insert_running(req)
            if n_new > 0:
                seqs.append(self._scheduled(req, cached, n_new))
                copy_ops.extend(ops or ())
                budget -= n_new
            else:
                # The leader's prompt[:-1] is all cached (or empty): fork now, and let each of the n
                # compute the last prompt token if there is room (else next step, as running work).
                for r in [req, *self._fork(req)]:
                    if budget <= 0 or len(seqs) >= max_seqs:
                        break
                    start = r.num_computed_tokens
                    ops = kv.allocate_slots(r.request_id, start + 1, reserve_watermark=reserve)
                    if ops is None:
                        break
                    seqs.append(self._scheduled(r, start, 1))
                    copy_ops.extend(ops)
                    budget -= 1
        return budget

    def _largest_fit(self, rid: str, start: int, n_new: int, *, reserve: bool) -> int:
        """Largest k < n_new whose slots can be allocated now (0 if none): binary search."""
        kv = self.kv
        lo, hi = 0, n_new - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kv.can_allocate(rid, start + mid, reserve_watermark=reserve):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _reserved_seats(self) -> int:
        """Sequence slots held for siblings of running leaders (they join at the fork)."""
        if not self._forks:
            return 0
        reqs = self._requests
        return sum(len(s) for lid, s in self._forks.items() if reqs[lid].status is _RUNNING)

    def _scheduled(self, req: Request, start: int, n_new: int) -> ScheduledSeq:
        rid = req.request_id
        tokens = self._tokens[rid]
        end = start + n_new
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        params = req.params
        return ScheduledSeq(
            request_id=rid,
            token_ids=tokens[start:end],
            start_pos=start,
            block_table=self.kv.get_block_table(rid),
            sample=end == len(tokens),
            params=params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            seed=None if params.seed is None else params.seed + req.sample_index,
        )

    def _fork(self, leader: Request) -> list[Request]:
        """Siblings of `leader` start sharing its blocks (it has computed prompt[:-1])."""
        sibs = self._forks.pop(leader.request_id, None)
        if not sibs:
            return []
        self._num_pending -= len(sibs)
        lid = leader.request_id
        for s in sibs:
            sid = s.request_id
            del self._leader_of[sid]
            self.kv.fork(lid, sid)
            s.status = _RUNNING
            s.num_computed_tokens = leader.num_computed_tokens
            s.num_cached_tokens = leader.num_cached_tokens
            self._insert_running(s)
        return sibs

    def _preempt(self, req: Request) -> None:
        """Free all of req's blocks and requeue it; it recomputes prompt + outputs later."""
        self.kv.free(req.request_id)
        self._remove_sorted(self._running, req)
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(req)

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput, res: RunnerOutput) -> list[RequestEvent]:
        """Apply one step's results: commit computed tokens, append samples, stop and free."""
        if res.step_id != out.step_id:
            raise ValueError(f"runner output for step {res.step_id}, expected {out.step_id}")
        now = time.monotonic()
        if self._t_schedule is not None and out.num_batched_tokens:
            dt = now - self._t_schedule
            if dt > 0:
                tps = out.num_batched_tokens / dt
                self._tokens_per_s = tps if self._tokens_per_s is None else (
                    0.9 * self._tokens_per_s + 0.1 * tps)

        kv = self.kv
        reqs = self._requests
        errors = res.errors
        sampled = res.sampled
        logprobs = res.logprobs
        max_len = self.max_model_len
        events: list[RequestEvent] = []
        for seq in out.seqs:
            rid = seq.request_id
            req = reqs.get(rid)
            if req is None or req.status is not _RUNNING:
                continue   # finished (aborted) since schedule()
            if errors and rid in errors:
                events.append(self._finish(req, FinishReason.ERROR, errors[rid]))
                continue
            tokens = self._tokens[rid]
            computed = seq.start_pos + len(seq.token_ids)
            req.num_computed_tokens = computed
            kv.commit(rid, tokens, computed)
            if not seq.sample:
                if rid in self._forks and computed == len(tokens) - 1:
                    self._fork(req)
                continue
            tok = sampled.get(rid)
            if tok is None:
                events.append(self._finish(req, FinishReason.ERROR, "the runner returned no token"))
                continue
            req.output_token_ids.append(tok)
            tokens.append(tok)
            params = req.params
            reason = None
            if tok in params.stop_token_ids or (not params.ignore_eos and tok in req.eos_token_ids):
                reason = FinishReason.STOP
            elif len(req.output_token_ids) >= params.max_tokens or len(tokens) >= max_len:
                reason = FinishReason.LENGTH
            if reason is None:
                ev = RequestEvent(
                    request_id=rid,
                    new_token_ids=[tok],
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_cached_tokens=req.num_cached_tokens,
                )
            else:
                ev = self._finish(req, reason)
                ev.new_token_ids = [tok]
            lp = logprobs.get(rid) if logprobs else None
            if lp is not None:
                ev.logprobs = [lp]
            events.append(ev)
        return events

    def finish_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestEvent | None:
        """End one request now (abort, stop string): its blocks are freed in this call.

        Returns its final event, or None if it is unknown or already finished. Siblings live on.
        """
        req = self._requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestEvent:
        rid = req.request_id
        status = req.status
        if status is _RUNNING:
            self.kv.free(rid, keep_warm=req.keep_warm)
            self._remove_sorted(self._running, req)
        elif status is _WAITING or status is _PREEMPTED:
            self._remove_sorted(self._waiting, req)
            self._waiting_tokens -= len(self._tokens[rid])
        elif status is _FORK:
            lid = self._leader_of.pop(rid)
            sibs = self._forks[lid]
            del sibs[next(i for i, s in enumerate(sibs) if s is req)]
            self._num_pending -= 1
            if not sibs:
                del self._forks[lid]
        # A leader that ends before the fork hands the group to its next sibling.
        sibs = self._forks.pop(rid, None)
        if sibs:
            heir, rest = sibs[0], sibs[1:]
            self._num_pending -= 1
            del self._leader_of[heir.request_id]
            if rest:
                self._forks[heir.request_id] = rest
                for s in rest:
                    self._leader_of[s.request_id] = heir.request_id
            heir.status = _WAITING
            self._insert_waiting(heir)
            if self._admit_blocked is not None and self._admit_blocked[0] == rid:
                self._admit_blocked = None

        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.first_scheduled_time is not None:
            self._finished_ids.append(rid)
        del self._requests[rid]
        del self._tokens[rid]
        del self._keys[rid]
        return RequestEvent(
            request_id=rid,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=max(0, req.num_cached_tokens),
            error=error,
        )

    # ------------------------------------------------------------------ sorted queues
    def _key(self, req: Request) -> tuple[int, float, int]:
        return self._keys[req.request_id]

    def _insert_waiting(self, req: Request) -> None:
        bisect.insort(self._waiting, req, key=self._key)
        self._waiting_tokens += len(self._tokens[req.request_id])

    def _insert_running(self, req: Request) -> None:
        bisect.insort(self._running, req, key=self._key)

    def _remove_sorted(self, queue: list[Request], req: Request) -> None:
        if queue and queue[-1] is req:
            queue.pop()
            return
        i = bisect.bisect_left(queue, self._keys[req.request_id], key=self._key)
        while queue[i] is not req:   # keys are unique: this runs at most once
            i += 1
        del queue[i]
