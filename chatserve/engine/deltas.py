"""What the engine hands the HTTP layer: `Delta` (one step's new output of one sample), the bounded
`DeltaChannel` that carries a request's deltas without ever making the engine wait, and `EngineStats`.

Plain data and asyncio only; the engine that fills them is engine.py.
"""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from chatserve.core.errors import ErrorCode
from chatserve.core.outputs import TokenLogprob


@dataclass
class Delta:
    """New output of one sample (`index`) of a request, as produced by one engine step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" on the sample's last delta
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prefix-cache hit of this sample's prompt
    error: str | None = None             # set with finish_reason "error"
    stop_reason: str | None = None       # the stop string that ended the sample, if one did
    error_code: ErrorCode | None = None  # why, for the HTTP status (chatserve.server.errors.status_for)
    # timings, set on a sample's last delta (seconds)
    ttft_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    # on each sample's first delta when params.prompt_logprobs is set: prompt positions 1..len-1
    prompt_logprobs: list[TokenLogprob] | None = None


class DeltaChannel:
    """A bounded FIFO of deltas the engine never waits on; overflow is reported to the caller."""

    def __init__(self, maxlen: int) -> None:
        self._items: collections.deque[Delta] = collections.deque()
        self._event = asyncio.Event()
        self._maxlen = maxlen
        self.closed = False

    def put(self, d: Delta, *, force: bool = False) -> bool:
        if self.closed:
            return True
        if len(self._items) >= self._maxlen and not force:
            return False
        self._items.append(d)
        self._event.set()
        return True

    def close(self) -> None:
        self.closed = True
        self._event.set()

    async def get(self) -> Delta | None:
        """Next delta, or None once closed and drained."""
        while not self._items:
            if self.closed:
                return None
            self._event.clear()
            await self._event.wait()
        return self._items.popleft()


@dataclass
class EngineStats:
    """A snapshot for /metrics and the stats line. Counters are totals since start."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_num_blocks: int = 0
    kv_used_blocks: int = 0
    kv_free_blocks: int = 0
    kv_cached_blocks: int = 0
    prefix_queries: int = 0      # tokens looked up in the prefix cache
    prefix_hits: int = 0         # tokens found
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_errors: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)   # finish reason → count
    active_requests: int = 0     # client requests with a live stream
    spec_num_drafts: int = 0     # speculative decoding: sequences verified with drafts
    spec_num_draft_tokens: int = 0     # draft tokens verified
    spec_num_accepted_tokens: int = 0  # draft tokens accepted
