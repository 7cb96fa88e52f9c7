"""ModelPool: the served models that are loaded, loaded on demand and unloaded when idle.

A request takes a `Lease` on its model: the first lease of an unloaded model loads it (the loader runs
the heavy work off the event loop, so other models keep streaming), concurrent requests for a loading
model wait for that same load, and a failed load fails every waiter with `LoadFailed`; the next request
tries again. Loading evicts the least recently used idle models under `max_loaded` and the memory
budget; a model with leases or running requests (`busy`) is never unloaded. An idle model is unloaded
after its keep-alive (Ollama's semantics: 0 = at once, negative = never; a lease may override it).

The pool also owns the shared KV cache budget (`kv_budget`, bytes; 0 = each model sizes its own): a load
is handed its share, the free budget ÷ the slots still empty (slots = min(max_loaded, models)), so the
first load gets budget ÷ slots and a later one also what earlier ones left over (a cache is whole
blocks); the bytes a loaded model really holds are counted against the budget until it unloads, and then
return to it for the next load. A live model's cache is never resized (its blocks hold running
sequences), so the budget is never over-committed.

Generic over what a load gives (`T`): the server's ServedModel, or a test's stand-in. No torch here.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

log = logging.getLogger("chatserve.models")

T = TypeVar("T")
REAP_INTERVAL_S = 0.25          # how often idle models are checked against their keep-alive


class PoolError(Exception):
    """A lease that cannot be granted; `retry_after` in seconds (None: retrying will not help)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


class UnknownModel(PoolError):
    pass


class NoRoom(PoolError):
    """Even with every idle model unloaded, the model does not fit (count or memory)."""

    def __init__(self, message: str, needed_bytes: int, retry_after: float = 5.0) -> None:
        super().__init__(message, retry_after)
        self.needed_bytes = needed_bytes


class LoadFailed(PoolError):
    pass


class Phase(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass
class _Entry(Generic[T]):
    name: str
    size: int                               # bytes it is expected to hold when loaded
    keep_alive: float                       # seconds idle before unloading; < 0 = never
    pinned: bool = False                    # never unloaded (a model the caller built itself)
    phase: Phase = Phase.UNLOADED
    value: T | None = None
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    transition: asyncio.Future[None] | None = None   # done when the running load/unload ends
    failed: BaseException | None = None     # why the last load failed (its waiters are told)
    loads: int = 0                          # loads started (a failed one included)
    waiting: int = 0                        # requests waiting for its load: it is not idle for them
    kv: int = 0                             # KV bytes held of the shared budget (reserved while loading)


@dataclass(frozen=True)
class ModelInfo:
    """One configured model as /v1/models and the banner show it."""

    name: str
    phase: str
    size: int
    leases: int
    loads: int
    kv_bytes: int = 0                       # its KV cache's bytes out of the shared budget (0: unloaded)


class Lease(Generic[T]):
    """A hold on one loaded model; `release()` (idempotent) ends it. `keep_alive` (seconds) is how long
    the model stays loaded once idle after this release (None: the pool's default), as Ollama's last
    request decides."""

    def __init__(self, pool: ModelPool[T], entry: _Entry[T], keep_alive: float | None) -> None:
        self._pool, self._entry, self.keep_alive = pool, entry, keep_alive
        self._released = False
        assert entry.value is not None
        self.value: T = entry.value

    @property
    def name(self) -> str:
        return self._entry.name

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._entry, self.keep_alive)

    def __del__(self) -> None:
        """A backstop: every server path releases its lease itself (the stream once the engine has the
        request, the route when its response ends); one dropped unreleased is still given back when
        collected, so its model can become idle again, and logged as the bug it is."""
        try:
            if not self._released:
                log.warning("a lease on model %s was dropped unreleased (given back now)", self._entry.name)
            self.release()
        except Exception:           # interpreter shutdown: nothing left to give back to
            pass


class ModelPool(Generic[T]):
    def __init__(self, *, load: Callable[[str, int | None], Awaitable[T]], unload: Callable[[T], Awaitable[None]],
                 busy: Callable[[T], bool], sizes: dict[str, int], keep_alive: float,
                 max_loaded: int, memory_budget: int = 0, pinned: tuple[str, ...] = (),
                 release_memory: Callable[[], Awaitable[None]] | None = None,
                 kv_budget: int = 0, kv_bytes: Callable[[T], int] | None = None) -> None:
        """load(name, kv_share): kv_share is the KV cache bytes the model may take (None without a shared
        budget); sizes: every model's name → bytes expected once loaded; memory_budget: 0 = no limit;
        release_memory: run after an unload once the pool holds no reference to the model (a garbage
        collection: an engine's parts refer to each other, and the next load must find the memory free);
        kv_budget: the KV bytes every loaded model's cache shares (0 = none); kv_bytes: what a loaded
        model's cache really holds (default: its whole share)."""
        self._load, self._unload, self._busy = load, unload, busy
        self.kv_budget, self._kv_bytes = max(0, kv_budget), kv_bytes
        self._release_memory = release_memory
        self.keep_alive = keep_alive
        self.max_loaded, self.memory_budget = max(1, max_loaded), memory_budget
        self._entries: dict[str, _Entry[T]] = {
            n: _Entry(n, s, keep_alive, pinned=n in pinned) for n, s in sizes.items()}
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self._lock = asyncio.Lock()              # one admission decision (evict + start a load) at a time

    # ---- reading -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def info(self) -> list[ModelInfo]:
        return [ModelInfo(e.name, e.phase.value, e.size, e.leases, e.loads, e.kv) for e in self._entries.values()]

    @property
    def kv_free(self) -> int:
        """Bytes of the shared KV budget no loaded (or loading) model holds."""
        return max(0, self.kv_budget - sum(e.kv for e in self._entries.values()))

    def kv_share(self, name: str) -> int | None:
        """The KV bytes `name` would be given if it loaded now (room already made): the free budget ÷ the
        slots still empty; None without a shared budget."""
        if not self.kv_budget:
            return None
        want = self._entries[name]
        live = [e for e in self._entries.values() if e.phase is not Phase.UNLOADED and e is not want]
        slots = min(self.max_loaded, len(self._entries))
        free = max(0, self.kv_budget - sum(e.kv for e in live))
        return free // max(1, slots - len(live))

    def loaded(self) -> list[tuple[str, T]]:
        return [(e.name, e.value) for e in self._entries.values()
                if e.phase is Phase.LOADED and e.value is not None]

    @property
    def closed(self) -> bool:
        return self._closed

    def peek(self, name: str) -> T | None:
        """The model if it is loaded now (no lease, no load)."""
        e = self._entries.get(name)
        return e.value if e is not None and e.phase is Phase.LOADED else None

    # ---- leasing -------------------------------------------------------------------------------
    async def acquire(self, name: str, keep_alive: float | None = None) -> Lease[T]:
        """A lease on `name`, loading it first when needed. Raises UnknownModel, NoRoom, LoadFailed."""
        e = self._entries.get(name)
        if e is None:
            raise UnknownModel(f"no model named {name!r}")
        while True:
            if self._closed:
                raise PoolError("the server is shutting down", retry_after=5.0)
            if e.phase is Phase.LOADED:
                e.leases += 1
                e.last_used = time.monotonic()
                return Lease(self, e, keep_alive)
            if e.transition is not None:            # loading or unloading: wait, then look again
                e.waiting += 1
                try:
                    await asyncio.shield(e.transition)
                finally:
                    e.waiting -= 1
                if e.phase is Phase.UNLOADED and e.failed is not None:
                    raise LoadFailed(f"loading the model {name!r} failed: {type(e.failed).__name__}: {e.failed}")
                continue
            async with self._lock:
                if e.phase is Phase.UNLOADED and e.transition is None:
                    await self._make_room(e)
                    self._start_load(e)

    def _release(self, e: _Entry[T], keep_alive: float | None) -> None:
        e.leases = max(0, e.leases - 1)
        e.last_used = time.monotonic()
        e.keep_alive = self.keep_alive if keep_alive is None else keep_alive   # the last request's (Ollama)
        self._ensure_reaper()

    # ---- loading and unloading -----------------------------------------------------------------
    def _start_load(self, e: _Entry[T]) -> None:
        e.phase = Phase.LOADING
        e.failed = None
        e.loads += 1
        share = self.kv_share(e.name)
        e.kv = share or 0                            # reserved: a concurrent load sees it taken
        e.transition = asyncio.get_running_loop().create_future()
        asyncio.ensure_future(self._run_load(e, share))

    async def _run_load(self, e: _Entry[T], share: int | None) -> None:
        fut = e.transition
        assert fut is not None
        try:
            e.value = await self._load(e.name, share)
            if share is not None and self._kv_bytes is not None:
                e.kv = self._kv_bytes(e.value)       # what it really holds: whole blocks, ≤ its share
            e.phase = Phase.LOADED
            e.last_used = time.monotonic()
            log.info("model %s loaded", e.name)
        except Exception as err:                     # every waiter sees it; the next request retries
            log.exception("loading model %s failed", e.name)
            e.value, e.phase, e.kv = None, Phase.UNLOADED, 0
            e.failed = err
        finally:
            e.transition = None
            fut.set_result(None)
        self._ensure_reaper()

    async def _make_room(self, want: _Entry[T]) -> None:
        """Unload least recently used idle models until `want` fits; NoRoom when it cannot (at once, with
        nothing unloaded, when it would not fit even alone beside the pinned models)."""
        pinned = [e for e in self._entries.values() if e.pinned and e.phase is not Phase.UNLOADED]
        if self.memory_budget and want.size + sum(e.size for e in pinned) > self.memory_budget:
            raise self._no_room(want, pinned, 0, True)
        while True:
            live = [e for e in self._entries.values() if e.phase is not Phase.UNLOADED and e is not want]
            used = sum(e.size for e in live)
            over_count = len(live) + 1 > self.max_loaded
            over_memory = bool(self.memory_budget) and used + want.size > self.memory_budget
            if not over_count and not over_memory:
                return
            idle = sorted((e for e in live if self._idle(e)), key=lambda e: e.last_used)
            if not idle:
                raise self._no_room(want, live, used, over_memory)
            await self._unload_entry(idle[0])

    def _no_room(self, want: _Entry[T], live: list[_Entry[T]], used: int, over_memory: bool) -> NoRoom:
        need = f"the model {want.name!r} needs {_mib(want.size)} (weights and KV cache)"
        pinned = sum(e.size for e in live if e.pinned)
        if over_memory and want.size > self.memory_budget - pinned:
            return NoRoom(f"{need}, more than the model memory budget of {_mib(self.memory_budget)} "
                          f"(--model-memory-budget) holds", want.size, retry_after=60.0)
        why = (f"{_mib(max(0, self.memory_budget - used))} of the {_mib(self.memory_budget)} budget is free"
               if over_memory else f"{len(live)} models are loaded (--max-loaded-models {self.max_loaded})")
        names = ", ".join(e.name for e in live)
        return NoRoom(f"{need} and cannot be loaded now: {why}, and every loaded model ({names}) is in use",
                      want.size)

    def _idle(self, e: _Entry[T]) -> bool:
        return (e.phase is Phase.LOADED and not e.pinned and e.leases == 0 and e.waiting == 0
                and e.value is not None and not self._busy(e.value))

    async def _unload_entry(self, e: _Entry[T]) -> None:
        e.phase = Phase.UNLOADING
        fut = e.transition = asyncio.get_running_loop().create_future()
        try:
            if e.value is not None:
                await self._unload(e.value)
            e.value = None
            if self._release_memory is not None:
                await self._release_memory()
        except Exception:
            log.exception("unloading model %s failed", e.name)
        finally:
            e.value, e.phase, e.transition, e.kv = None, Phase.UNLOADED, None, 0   # its share returns
            fut.set_result(None)
        log.info("model %s unloaded", e.name)

    async def unload(self, name: str) -> bool:
        """Unload `name` now if it is idle (keep_alive 0 does this after the last request)."""
        e = self._entries[name]
        async with self._lock:
            if not self._idle(e):
                return False
            await self._unload_entry(e)
            return True

    # ---- keep-alive --------------------------------------------------------------------------
    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            if not self._closed:
                self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """While some unpinned model is loaded: unload the idle ones whose keep-alive has run out."""
        while not self._closed:
            now = time.monotonic()
            watched = False
            for e in list(self._entries.values()):
                if e.phase is not Phase.LOADED or e.pinned or e.keep_alive < 0:
                    continue
                watched = True
                if e.leases or e.waiting or (e.value is not None and self._busy(e.value)):
                    e.last_used = now                # idle time counts from the last request's end
                elif now - e.last_used >= e.keep_alive:
                    await self.unload(e.name)
            if not watched:
                return
            await asyncio.sleep(REAP_INTERVAL_S)

    async def close(self, unload: Callable[[T], Awaitable[None]] | None = None) -> None:
        """Refuse new leases, stop the reaper, and unload every loaded model at once with `unload`
        (default: the pool's; the server's drains each model's streams first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        for e in self._entries.values():
            if e.transition is not None:
                await asyncio.shield(e.transition)
        done = unload or self._unload
        live = [e for e in self._entries.values() if e.phase is Phase.LOADED and e.value is not None]
        await asyncio.gather(*(done(e.value) for e in live if e.value is not None), return_exceptions=True)
        for e in live:
            e.value, e.phase, e.kv = None, Phase.UNLOADED, 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"
