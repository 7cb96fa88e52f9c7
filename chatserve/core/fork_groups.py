"""ForkGroups: the siblings of an n > 1 request that wait for their leader's fork (WAITING_FOR_FORK),
and which sibling inherits the group when the leader ends first.

Bookkeeping only: the scheduler forks the KV blocks and moves requests between its queues.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # used only through its attributes
    from chatserve.core.live_request import LiveRequest


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
