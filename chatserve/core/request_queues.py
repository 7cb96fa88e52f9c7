"""RequestQueues: where the scheduler's live requests are: by id, the waiting and running queues each
kept sorted by key, and (ForkGroups) the n > 1 siblings waiting for their leader's fork.

Bookkeeping only: when a request moves is the scheduler's decision; no KV blocks are touched here.
"""
from __future__ import annotations

import bisect
from operator import attrgetter
from typing import Any

from chatserve.core.live_request import LiveRequest
from chatserve.core.request import RequestStatus

_key = attrgetter("key")
_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_FORK = RequestStatus.WAITING_FOR_FORK


class RequestQueues:
    """Every unfinished request by id; WAITING / PREEMPTED ones in `waiting`, RUNNING ones in `running`
    (both sorted by key: lower first), WAITING_FOR_FORK ones in `groups`."""

    def __init__(self) -> None:
        self.entries: dict[str, LiveRequest] = {}
        self.waiting: list[LiveRequest] = []
        self.running: list[LiveRequest] = []
        self.groups = ForkGroups()
        self.waiting_tokens = 0          # tokens to compute for the waiting queue

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.groups.num_pending

    def add(self, group: list[LiveRequest]) -> None:
        """A new group of samples of one prompt: its leader waits, its siblings wait for its fork."""
        for e in group:
            self.entries[e.rid] = e
        leader, siblings = group[0], group[1:]
        leader.req.status = _WAITING
        self.insert_waiting(leader)
        for s in siblings:
            s.req.status = _FORK
        if siblings:
            self.groups.add(leader.rid, siblings)

    def insert_waiting(self, e: LiveRequest) -> None:
        bisect.insort(self.waiting, e, key=_key)
        self.waiting_tokens += len(e.tokens)

    def pop_waiting(self, i: int) -> LiveRequest:
        e = self.waiting.pop(i)
        self.waiting_tokens -= len(e.tokens)
        return e

    def insert_running(self, e: LiveRequest) -> None:
        bisect.insort(self.running, e, key=_key)

    def remove_running(self, e: LiveRequest) -> None:
        _remove_sorted(self.running, e)

    def remove(self, e: LiveRequest) -> None:
        """A finishing request leaves its queue (or fork group) and the table. A leader that ends
        before the fork hands its group to the next sibling, which joins the waiting queue."""
        status = e.req.status
        if status is _RUNNING:
            _remove_sorted(self.running, e)
        elif status is _WAITING or status is _PREEMPTED:
            _remove_sorted(self.waiting, e)
            self.waiting_tokens -= len(e.tokens)
        elif status is _FORK:
            self.groups.remove(e)
        heir = self.groups.hand_over(e.rid)
        if heir is not None:
            heir.req.status = _WAITING
            self.insert_waiting(heir)
        del self.entries[e.rid]

    def reserved_seats(self) -> int:
        """Sequence slots held for siblings of running leaders (they join at the fork)."""
        siblings = self.groups.siblings
        if not siblings:
            return 0
        ents = self.entries
        return sum(len(s) for lid, s in siblings.items() if ents[lid].req.status is _RUNNING)

    def progress(self, request_id: str) -> dict[str, Any] | None:
        """Where a request's prompt stands: {"phase": "queued", "queue_position": 1-based} while it
        waits, {"phase": "prefill", "prefill_done", "prefill_total", "cached_tokens"} while its prompt
        is being computed, None once it decodes (or is unknown). O(waiting) while queued."""
        e = self.entries.get(request_id)
        if e is None:
            return None
        if e in self.waiting:
            return {"phase": "queued", "queue_position": self.waiting.index(e) + 1}
        req = e.req
        total = len(req.prompt_token_ids)
        if req.num_computed_tokens >= total:
            return None
        return {"phase": "prefill", "prefill_done": req.num_computed_tokens, "prefill_total": total,
                "cached_tokens": max(0, req.num_cached_tokens)}


def _remove_sorted(queue: list[LiveRequest], e: LiveRequest) -> None:
    if queue and queue[-1] is e:
        queue.pop()
        return
    i = bisect.bisect_left(queue, e.key, key=_key)
    while queue[i] is not e:   # keys are unique: this never loops more than once
        i += 1
    del queue[i]


class ForkGroups:
    """leader id → its siblings still waiting for the fork (in sample order), and each one's leader."""

    def __init__(self) -> None:
        self.siblings: dict[str, list[LiveRequest]] = {}   # read on the scheduler's hot path
        self._leader_of: dict[str, str] = {}
        self.num_pending = 0                                # siblings waiting for a fork

    def add(self, leader_id: str, siblings: list[LiveRequest]) -> None:
        self.siblings[leader_id] = siblings
        for s in siblings:
            self._leader_of[s.rid] = leader_id
        self.num_pending += len(siblings)

    def release(self, leader_id: str) -> list[LiveRequest]:
        """The siblings of a leader that has computed prompt[:-1]; they leave the group to fork now."""
        sibs = self.siblings.pop(leader_id, None)
        if not sibs:
            return []
        self.num_pending -= len(sibs)
        for s in sibs:
            del self._leader_of[s.rid]
        return sibs

    def remove(self, sibling: LiveRequest) -> None:
        """A sibling that ends before the fork leaves its group."""
        lid = self._leader_of.pop(sibling.rid)
        sibs = self.siblings[lid]
        del sibs[next(k for k, s in enumerate(sibs) if s is sibling)]
        self.num_pending -= 1
        if not sibs:
            del self.siblings[lid]

    def hand_over(self, leader_id: str) -> LiveRequest | None:
        """A leader that ends before the fork: its next sibling leads the rest. Returns that heir (no
        longer waiting for a fork; it prefills the prompt itself), or None when there is none."""
        sibs = self.siblings.pop(leader_id, None)
        if not sibs:
            return None
        heir, rest = sibs[0], sibs[1:]
        self.num_pending -= 1
        del self._leader_of[heir.rid]
        if rest:
            self.siblings[heir.rid] = rest
            for s in rest:
                self._leader_of[s.rid] = heir.rid
        return heir
