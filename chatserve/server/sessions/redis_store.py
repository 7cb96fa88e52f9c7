"""Sessions in Redis under `chatserve:session:*`, with a local cache and a write outbox.

Redis is never on the generation path: writes that cannot reach it wait in a bounded outbox and reads
fall back to the sessions this process touched. A delete leaves a tombstone, so no replica's resync
or late write brings a deleted chat back. Not the interface (store.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from collections import OrderedDict
from typing import Any

from chatserve.server.sessions.session import Session
from chatserve.server.redis_check import redact_url
from chatserve.server.sessions.store import (Mutation, StoreUnavailable,
                                             touch)

log = logging.getLogger("chatserve.sessions")

NAMESPACE = "chatserve:session"
DEFAULT_TTL_S = 30 * 24 * 3600
DELETED = -2                      # what the put script answers for a deleted session


# Put-if-newer: writes the session and its owner-index entry in one step, refreshing both TTLs.
# Returns 0 when written, the stored rev when it is already >= ours (a lost race or a stale replay),
# -1 when the id belongs to another owner, -2 when the session was deleted (its tombstone).
_PUT_LUA = """
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return -2 end
local cur = redis.call('HGET', KEYS[1], 'rev')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return tonumber(cur) end
local own = redis.call('HGET', KEYS[1], 'owner')
if own and own ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], 'rev', ARGV[1], 'owner', ARGV[2], 'updated', ARGV[3], 'data', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 0
"""

# Delete: the hash becomes a tombstone (owner, deleted=1, no data) that lives for the TTL.
_DELETE_LUA = """
local own = redis.call('HGET', KEYS[1], 'owner')
redis.call('ZREM', KEYS[2], ARGV[2])
if own and own ~= ARGV[1] then return 0 end
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return 0 end
redis.call('HDEL', KEYS[1], 'data', 'updated')
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'deleted', '1')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


class _RedisDown(Exception):
    """Redis did not answer in time (internal: callers fall back to the cache / outbox)."""


class RedisSessionStore:
    """Sessions in Redis under `chatserve:session:*`, with a local cache and a write outbox.

    Keys: `{ns}:{id}` a hash (rev, owner, updated, data=JSON of Session.to_dict, any schema), or after
    a delete a tombstone (owner, deleted=1); `{ns}:owner:{sha256(owner)}` a sorted set of ids scored by
    updated time. All carry the TTL, refreshed on every write. Healthy writes are compare-and-set on
    `rev` (Lua); when Redis is down they apply to the cached copy and queue.
    """

    persistent = True

    def __init__(self, url: str, *, ttl_s: int = DEFAULT_TTL_S, op_timeout_s: float = 0.5,
                 outbox_limit: int = 1000, cache_limit: int = 2048, retry_interval_s: float = 0.25,
                 namespace: str = NAMESPACE) -> None:
        self.url = url
        self.ttl_s = int(ttl_s)
        self.op_timeout_s = op_timeout_s
        self.outbox_limit = outbox_limit
        self.cache_limit = cache_limit
        self.retry_interval_s = retry_interval_s
        self.ns = namespace
        self._client: Any = None
        self._put = None
        self._del = None
        self._cache: OrderedDict[str, Session] = OrderedDict()     # sessions this process touched
        self._outbox: OrderedDict[str, tuple[str, Session]] = OrderedDict()  # id -> ("put"|"delete", s)
        self._healthy = True
        self._last_error: str | None = None
        self._recovery: asyncio.Task | None = None
        self.flushed_writes = 0

    # ── plumbing ──────────────────────────────────────────────────────────────────────────────
    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            self._client = aioredis.Redis.from_url(
                self.url, socket_connect_timeout=self.op_timeout_s, socket_timeout=self.op_timeout_s,
                retry=Retry(NoBackoff(), 0), decode_responses=True)
            self._put = self._client.register_script(_PUT_LUA)
            self._del = self._client.register_script(_DELETE_LUA)
        return self._client

    def _key(self, sid: str) -> str:
        return f"{self.ns}:{sid}"

    def _owner_key(self, owner: str) -> str:
        return f"{self.ns}:owner:{hashlib.sha256(owner.encode()).hexdigest()[:32]}"

    async def _call(self, aw: Any) -> Any:
        if not self._healthy:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise _RedisDown(self._last_error or "redis down")
        from redis.exceptions import ResponseError
        try:
            return await asyncio.wait_for(aw, self.op_timeout_s)
        except ResponseError:                 # a bug of ours, not an outage
            raise
        except Exception as e:                # timeouts, connection and socket errors
            self._mark_down(e)
            raise _RedisDown(str(e)) from e

    def _mark_down(self, e: BaseException) -> None:
        if self._healthy:
            log.warning("session store: redis unavailable (%s); buffering writes", e)
        self._healthy = False
        self._last_error = f"{type(e).__name__}: {e}"
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    def _remember(self, s: Session) -> None:
        self._cache[s.id] = s.clone()
        self._cache.move_to_end(s.id)
        excess = len(self._cache) - self.cache_limit
        if excess > 0:                                   # least recently used first; pending writes stay
            for sid in [k for k in self._cache if k not in self._outbox][:excess]:
                del self._cache[sid]

    def _enqueue(self, op: str, s: Session) -> None:
        if s.id not in self._outbox and len(self._outbox) >= self.outbox_limit:
            raise StoreUnavailable("session store unavailable and its write buffer is full")
        self._outbox[s.id] = (op, s.clone())
        self._outbox.move_to_end(s.id)
        if self._healthy:          # an earlier write is pending but redis is up: flush soon
            self._mark_flush()

    def _mark_flush(self) -> None:
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _write(self, s: Session) -> int:
        self._redis()
        return int(await self._call(self._put(
            keys=[self._key(s.id), self._owner_key(s.owner)],
            args=[s.rev, s.owner, repr(s.updated), json.dumps(s.to_dict()), self.ttl_s, s.id])))

    async def _load(self, sid: str) -> Session | None:
        raw = await self._call(self._redis().hget(self._key(sid), "data"))
        return _decode(sid, raw) if raw else None

    # ── recovery: flush the outbox, then make Redis hold at least what this process knows ───────
    async def _recover(self) -> None:
        while True:
            if not self._healthy:
                await asyncio.sleep(self.retry_interval_s)
            try:
                await asyncio.wait_for(self._redis().ping(), self.op_timeout_s)
                was_down = not self._healthy
                self._healthy = True
                await self._flush()
                if was_down:
                    await self._resync()
                    log.warning("session store: redis is back; %d buffered writes flushed",
                                self.flushed_writes)
                if not self._outbox:
                    self._last_error = None
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:                       # still down: keep buffering
                self._healthy = False
                self._last_error = f"{type(e).__name__}: {e}"

    async def _flush(self) -> None:
        while self._outbox:
            sid, (op, s) = next(iter(self._outbox.items()))
            if op == "put":
                r = await self._write(s)
                if r == DELETED:
                    log.info("session %s: deleted meanwhile; our buffered write dropped", sid)
                    self._cache.pop(sid, None)
                elif r > 0:
                    log.warning("session %s: a newer revision (%d) is in redis; ours (%d) dropped",
                                sid, r, s.rev)
            else:
                self._redis()
                await self._call(self._del(keys=[self._key(sid), self._owner_key(s.owner)],
                                           args=[s.owner, sid, self.ttl_s]))
            # the entry may have been replaced while we awaited: only drop what we wrote
            if self._outbox.get(sid, (None, None))[1] is s:
                del self._outbox[sid]
            self.flushed_writes += 1

    async def _resync(self) -> None:
        """After an outage Redis may have lost data (restart without persistence): re-put what we know."""
        ids = [sid for sid in self._cache if sid not in self._outbox]
        if not ids:
            return
        pipe = self._redis().pipeline(transaction=False)
        for sid in ids:
            pipe.hget(self._key(sid), "rev")
        revs = await self._call(pipe.execute())
        for sid, rev in zip(ids, revs):
            s = self._cache.get(sid)
            if s is not None and (rev is None or int(rev) < s.rev):
                if await self._write(s) == DELETED:          # deleted elsewhere: stays deleted
                    self._cache.pop(sid, None)

    # ── the store API ───────────────────────────────────────────────────────────────────────
    async def create(self, session: Session) -> Session:
        touch(session)
        self._remember(session)
        try:
            if self._outbox:
                raise _RedisDown("outbox not empty")
            await self._write(session)
        except _RedisDown:
            self._enqueue("put", session)
        return session.clone()

    async def get(self, owner: str, sid: str) -> Session | None:
        s: Session | None
        if sid in self._outbox:
            s = None if self._outbox[sid][0] == "delete" else self._cache.get(sid)
        else:
            try:
                s = await self._load(sid)
                if s is not None:
                    self._remember(s)
                else:
                    self._cache.pop(sid, None)
            except _RedisDown:
                s = self._cache.get(sid)
                if s is None:
                    raise StoreUnavailable("session store unavailable; this session is not cached here")
        return s.clone() if s is not None and s.owner == owner else None

    async def list(self, owner: str, limit: int = 100) -> list[Session]:
        try:
            r = self._redis()
            ids = await self._call(r.zrevrange(self._owner_key(owner), 0, limit - 1))
            out: list[Session] = []
            if ids:
                raws = await self._call(self._multi_data(ids))
                stale = []
                for sid, raw in zip(ids, raws):
                    if not raw:
                        stale.append(sid)
                        continue
                    s = _decode(sid, raw)
                    if s is not None and s.owner == owner:
                        out.append(s)
                if stale:                                   # expired sessions leave index entries
                    await self._call(r.zrem(self._owner_key(owner), *stale))
            by_id = {s.id: s for s in out}
            for sid, (op, s) in self._outbox.items():       # our pending writes are newer
                if s.owner != owner:
                    continue
                if op == "delete":
                    by_id.pop(sid, None)
                else:
                    by_id[sid] = self._cache.get(sid, s)
            out = list(by_id.values())
        except _RedisDown:
            out = [s for sid, s in self._cache.items()
                   if s.owner == owner and self._outbox.get(sid, ("put",))[0] != "delete"]
        out.sort(key=lambda s: s.updated, reverse=True)
        return [s.clone() for s in out[:limit]]

    async def _multi_data(self, ids: list[str]) -> list[str | None]:
        pipe = self._redis().pipeline(transaction=False)
        for sid in ids:
            pipe.hget(self._key(sid), "data")
        return await pipe.execute()

    async def update(self, owner: str, sid: str, fn: Mutation) -> Session | None:
        for attempt in range(32):                           # compare-and-set retries
            if attempt:
                await asyncio.sleep(secrets.randbelow(1000) / 1e6 * min(attempt, 10))
            if sid in self._outbox or not self._healthy:
                return self._update_local(owner, sid, fn)
            try:
                cur = await self._load(sid)
            except _RedisDown:
                return self._update_local(owner, sid, fn)
            if cur is None or cur.owner != owner:
                return None
            work = cur.clone()
            fn(work)
            touch(work)
            work.rev = cur.rev + 1
            try:
                r = await self._write(work)
            except _RedisDown:
                self._remember(work)
                self._enqueue("put", work)
                return work.clone()
            if r == 0:
                self._remember(work)
                return work.clone()
            if r < 0:
                return None
        raise StoreUnavailable("session is being updated concurrently; try again")

    def _update_local(self, owner: str, sid: str, fn: Mutation) -> Session | None:
        cur = self._cache.get(sid)
        if cur is None:
            raise StoreUnavailable("session store unavailable; this session is not cached here")
        if cur.owner != owner or self._outbox.get(sid, ("put",))[0] == "delete":
            return None
        work = cur.clone()
        fn(work)
        touch(work)
        self._enqueue("put", work)
        self._remember(work)
        return work.clone()

    async def delete(self, owner: str, sid: str) -> bool:
        s = await self.get(owner, sid)
        if s is None:
            return False
        self._cache.pop(sid, None)
        try:
            if sid in self._outbox:
                raise _RedisDown("pending writes")
            self._redis()
            return bool(await self._call(self._del(keys=[self._key(sid), self._owner_key(owner)],
                                                   args=[owner, sid, self.ttl_s])))
        except _RedisDown:
            self._enqueue("delete", s)
            return True

    def status(self) -> dict[str, Any]:
        return {"backend": "redis", "persistent": True, "degraded": not self._healthy,
                "pending_writes": len(self._outbox), "outbox_limit": self.outbox_limit,
                "cached_sessions": len(self._cache), "error": self._last_error}

    def describe(self) -> str:
        return f"sessions: redis at {redact_url(self.url)} (persisted, TTL {self.ttl_s // 86400} d)"

    async def aclose(self) -> None:
        if self._outbox and self._healthy:
            try:
                await self._flush()
            except _RedisDown:
                pass
        if self._outbox:
            log.error("session store: %d buffered writes not flushed (redis down at shutdown)",
                      len(self._outbox))
        if self._recovery is not None:
            self._recovery.cancel()
        if self._client is not None:
            try:
                await self._client.aclose()
            except Exception:
                pass
            self._client = None


def _decode(sid: str, raw: str) -> Session | None:
    """A stored record, or None (logged) when it cannot be read back: one bad record hides only itself."""
    try:
        return Session.from_dict(json.loads(raw))
    except Exception as e:
        log.warning("session %s: stored record unreadable, skipped: %s: %s", sid, type(e).__name__, e)
        return None
