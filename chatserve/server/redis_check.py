"""Whether the server's Redis (--redis-url) answers and accepts our password: checked at startup for
the banner, then watched in the background so `/ready` can say why the server is degraded and the
server recovers by itself when Redis comes back.

Not the session store (it has its own outbox and resync) and not rate limiting (ratelimit.py).
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

log = logging.getLogger("chatserve.server")
CHECK_TIMEOUT_S = 2.0
RETRY_S = 2.0          # while degraded
WATCH_S = 10.0         # while healthy


def redact_url(url: str) -> str:
    """The URL with any user:password part replaced, for banners and logs."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def _why(e: BaseException) -> tuple[str, str]:
    """(public reason for /ready, detailed reason for the banner and logs)."""
    import redis.exceptions as rx
    text = str(e) or type(e).__name__
    if isinstance(e, rx.AuthenticationError) or any(w in text for w in ("WRONGPASS", "NOAUTH", "invalid password",
                                                                       "invalid username-password")):
        return "redis authentication failed", f"authentication failed ({text}): check the password in --redis-url"
    if isinstance(e, (rx.ConnectionError, rx.TimeoutError, OSError, asyncio.TimeoutError)):
        return "redis unreachable", f"unreachable ({text})"
    return "redis error", f"{type(e).__name__}: {text}"


class RedisCheck:
    """ok / reason for one Redis URL. `check_sync()` before the banner; `start()`/`stop()` as hooks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok: bool | None = None            # None = not checked yet
        self.reason: str | None = None         # public: no host, port or password
        self.detail: str | None = None         # for the operator's log and banner
        self._task: asyncio.Task | None = None

    def _record(self, e: BaseException | None) -> None:
        was = self.ok
        if e is None:
            self.ok, self.reason, self.detail = True, None, None
            if was is False:
                log.warning("Redis at %s answers again: no longer degraded", redact_url(self.url))
            return
        self.ok = False
        self.reason, self.detail = _why(e)
        if was is not False:
            log.error("Redis at %s: %s; serving degraded, retrying every %.0f s",
                      redact_url(self.url), self.detail, RETRY_S)

    def check_sync(self, timeout: float = CHECK_TIMEOUT_S) -> bool:
        """Connect, authenticate and PING once (blocking; for startup, before the event loop)."""
        import redis
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=timeout, socket_connect_timeout=timeout)
            try:
                client.ping()
            finally:
                client.close()
            self._record(None)
        except Exception as e:
            self._record(e)
        return bool(self.ok)

    async def check(self, timeout: float = CHECK_TIMEOUT_S) -> bool:
        import redis.asyncio as aredis
        client: Any = aredis.Redis.from_url(self.url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            await asyncio.wait_for(client.ping(), timeout + 0.5)
            self._record(None)
        except Exception as e:
            self._record(e)
        finally:
            try:
                await client.aclose()
            except Exception:
                pass
        return bool(self.ok)

    def banner_line(self) -> str:
        where = redact_url(self.url)
        if self.ok:
            return f"  redis      {where}: connected, authenticated"
        if self.ok is None:
            return f"  redis      {where}: not checked yet"
        return (f"  redis      DEGRADED: {where} {self.detail}; sessions stay in this process and rate "
                "limits count per process until it answers (retrying)")

    def ready_info(self) -> dict[str, Any]:
        return {"redis": "ok" if self.ok else (self.reason or "not checked")}

    async def _watch(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(WATCH_S if self.ok else RETRY_S)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
