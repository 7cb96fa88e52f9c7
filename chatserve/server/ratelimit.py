"""Per-caller request and token rate limits over a sliding one-minute window (429 + Retry-After).

The windows live in Redis when the server has --redis-url (so N replicas enforce one limit, not N),
in process otherwise; the `limits` library keeps them (sliding-window counters, atomic in Redis). While
Redis is unreachable each process falls back to its own window. Off when both limits are 0.
Not authentication (auth.py) and not the order of admission checks (prompt_guard.py).
"""
from __future__ import annotations

import logging
import time

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from chatserve.server.errors import APIError

log = logging.getLogger("chatserve.server")
WINDOW = 60.0
NAMESPACE = "chatserve:rl"


def redis_storage(url: str) -> Storage:
    """The limits library's asyncio Redis storage on redis-py (the client chatserve already uses)."""
    return RedisStorage("async+" + url, implementation="redispy", socket_timeout=0.5,
                        socket_connect_timeout=0.5, key_prefix=NAMESPACE)


class RateLimiter:
    """`check(key)` before any work (refuses once a window is already full), `charge(key, tokens)`
    once the request's cost is known (prompt tokens + max_tokens × n)."""

    def __init__(self, rpm: int = 0, tpm: int = 0, storage: Storage | None = None) -> None:
        self.rpm, self.tpm = rpm, tpm
        self._rpm = RateLimitItemPerMinute(rpm, namespace="req") if rpm else None
        self._tpm = RateLimitItemPerMinute(tpm, namespace="tok") if tpm else None
        self._local = SlidingWindowCounterRateLimiter(MemoryStorage())
        self._shared = SlidingWindowCounterRateLimiter(storage) if storage is not None else None
        self._warned_at = 0.0

    @property
    def enabled(self) -> bool:
        return self.rpm > 0 or self.tpm > 0

    async def _call(self, method: str, *args, **kwargs):
        """Run a strategy call on the shared window, or on the local one while Redis fails."""
        if self._shared is not None:
            try:
                return await getattr(self._shared, method)(*args, **kwargs)
            except Exception as e:         # Redis down or refusing: limit per process meanwhile
                now = time.monotonic()
                if now - self._warned_at > 30:
                    self._warned_at = now
                    log.warning("rate limits: Redis unavailable (%s); counting in this process",
                                type(e).__name__)
        return await getattr(self._local, method)(*args, **kwargs)

    async def _retry_after(self, item, key: str) -> float:
        stats = await self._call("get_window_stats", item, key)
        return min(WINDOW, max(1.0, float(stats.reset_time) - time.time()))

    async def _refuse(self, item, key: str, message: str) -> None:
        raise APIError(429, message, code="rate_limit_exceeded", retry_after=await self._retry_after(item, key))

    async def check(self, key: str) -> None:
        """429 when the caller's window is already full (no request or no token left): cheap, and
        before parsing or tokenizing anything."""
        if self._rpm is not None and not await self._call("test", self._rpm, key):
            await self._refuse(self._rpm, key, f"rate limit: {self.rpm} requests per minute")
        if self._tpm is not None and not await self._call("test", self._tpm, key):
            await self._refuse(self._tpm, key, f"rate limit: {self.tpm} tokens per minute")

    async def charge(self, key: str, tokens: int) -> None:
        """Record one request costing `tokens`, or raise 429 (the request is then not counted)."""
        if self._tpm is not None and tokens > self.tpm:
            raise APIError(429, f"request of {tokens} tokens exceeds the {self.tpm} tokens per minute "
                           "limit", code="rate_limit_exceeded", retry_after=WINDOW)
        if self._tpm is not None and not await self._call("test", self._tpm, key, cost=tokens):
            await self._refuse(self._tpm, key, f"rate limit: {self.tpm} tokens per minute")
        if self._rpm is not None and not await self._call("hit", self._rpm, key):
            await self._refuse(self._rpm, key, f"rate limit: {self.rpm} requests per minute")
        if self._tpm is not None and not await self._call("hit", self._tpm, key, cost=tokens):
            await self._refuse(self._tpm, key, f"rate limit: {self.tpm} tokens per minute")

    async def aclose(self) -> None:
        if self._shared is not None:
            storage = self._shared.storage
            close = getattr(storage, "aclose", None) or getattr(storage, "close", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    pass
