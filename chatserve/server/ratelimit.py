"""Per-owner request and token rate limits over a sliding 60 s window (429 + Retry-After).

In-process only; off when both limits are 0. Not authentication (auth.py).
"""
from __future__ import annotations

import collections
import time

from chatserve.server.errors import APIError

WINDOW = 60.0


class RateLimiter:
    def __init__(self, rpm: int = 0, tpm: int = 0, clock=time.monotonic) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self._log: dict[str, collections.deque[tuple[float, int]]] = {}

    @property
    def enabled(self) -> bool:
        return self.rpm > 0 or self.tpm > 0

    def charge(self, owner: str, tokens: int) -> None:
        """Record one request costing `tokens` (prompt + max_tokens), or raise 429."""
        if not self.enabled:
            return
        now = self.clock()
        q = self._log.setdefault(owner, collections.deque())
        while q and q[0][0] <= now - WINDOW:
            q.popleft()
        if self.rpm and len(q) + 1 > self.rpm:
            raise APIError(429, f"rate limit: {self.rpm} requests per minute", code="rate_limit_exceeded",
                           retry_after=q[0][0] + WINDOW - now)
        if self.tpm:
            if tokens > self.tpm:
                raise APIError(429, f"request of {tokens} tokens exceeds the {self.tpm} tokens per minute "
                               "limit", code="rate_limit_exceeded", retry_after=WINDOW)
            used = sum(t for _, t in q)
            if used + tokens > self.tpm:
                # the wait until enough old charges expire
                need, acc, wait = used + tokens - self.tpm, 0, WINDOW
                for ts, t in q:
                    acc += t
                    if acc >= need:
                        wait = ts + WINDOW - now
                        break
                raise APIError(429, f"rate limit: {self.tpm} tokens per minute", code="rate_limit_exceeded",
                               retry_after=wait)
        q.append((now, tokens))
        if len(self._log) > 100_000:           # bound memory: drop idle owners
            for k in [k for k, v in self._log.items() if not v or v[-1][0] <= now - WINDOW][:50_000]:
                del self._log[k]
