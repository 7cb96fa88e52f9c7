"""ModelPool (chatserve/engine/model_pool.py) with scripted loads: one load for concurrent requests, a
failed load told to every waiter and retried by the next request, LRU eviction of idle models under the
count and memory limits, a model in use never unloaded, keep-alive expiry, and a request that arrives
while its model is being unloaded, and the shared KV budget handed out on load and given back on unload.
Loads and unloads are gated by events, so nothing depends on timing."""
from __future__ import annotations

import asyncio

import pytest

from chatserve.engine.model_pool import LoadFailed, ModelPool, NoRoom

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


class Models:
    """Scripted loader: `gate[name]` (when set) holds a load until released; `fail` names loads that raise;
    `busy` names models whose engines still run requests; `shares` records the KV share each load was
    given, and a loaded model's cache holds whole `block`-byte blocks of it (`kv`)."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.gate: dict[str, asyncio.Event] = {}
        self.unload_gate: asyncio.Event | None = None
        self.fail: set[str] = set()
        self.busy: set[str] = set()
        self.shares: list[tuple[str, int | None]] = []
        self.block = 7 * MiB

    async def load(self, name: str, kv_share: int | None = None) -> str:
        self.loads.append(name)
        self.shares.append((name, kv_share))
        if name in self.gate:
            await self.gate[name].wait()
        if name in self.fail:
            raise OSError(f"{name}: truncated file")
        return f"model:{name}"

    async def unload(self, value: str) -> None:
        if self.unload_gate is not None:
            await self.unload_gate.wait()
        self.unloads.append(value.split(":", 1)[1])

    def pool(self, sizes: dict[str, int], **kw) -> ModelPool[str]:
        kw.setdefault("keep_alive", -1.0)
        kw.setdefault("max_loaded", 3)
        return ModelPool(load=self.load, unload=self.unload, busy=lambda v: v.split(":", 1)[1] in self.busy,
                         sizes=sizes, kv_bytes=self.kv, **kw)

    def kv(self, value: str) -> int:
        """The bytes a loaded model's cache holds: its share in whole blocks."""
        share = next(s for n, s in reversed(self.shares) if n == value.split(":", 1)[1])
        return (share or 0) // self.block * self.block


async def until(cond, what: str) -> None:
    """Wait for `cond()` (a hang guard of many event-loop turns, not a speed limit)."""
    for _ in range(4000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def phases(pool: ModelPool) -> dict[str, str]:
    return {i.name: i.phase for i in pool.info()}


async def test_concurrent_requests_for_a_loading_model_share_one_load():
    m = Models()
    m.gate["a"] = asyncio.Event()
    pool = m.pool({"a": MiB})
    waiters = [asyncio.ensure_future(pool.acquire("a")) for _ in range(5)]
    await until(lambda: m.loads, "the load started")
    assert phases(pool)["a"] == "loading" and not any(w.done() for w in waiters)
    m.gate["a"].set()
    leases = await asyncio.gather(*waiters)
    assert m.loads == ["a"] and {lease.value for lease in leases} == {"model:a"}
    assert [i.leases for i in pool.info()] == [5]
    for lease in leases:
        lease.release()
        lease.release()                              # idempotent
    assert [i.leases for i in pool.info()] == [0]


async def test_a_failed_load_fails_every_waiter_and_the_next_request_retries():
    m = Models()
    m.gate["a"], m.fail = asyncio.Event(), {"a"}
    pool = m.pool({"a": MiB})
    waiters = [asyncio.ensure_future(pool.acquire("a")) for _ in range(3)]
    await until(lambda: m.loads, "the load started")
    m.gate["a"].set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, LoadFailed) and "truncated file" in str(r) for r in results)
    assert phases(pool)["a"] == "unloaded"
    m.fail.clear()
    lease = await pool.acquire("a")                  # tries again
    assert lease.value == "model:a" and m.loads == ["a", "a"]


async def test_the_least_recently_used_idle_model_is_evicted_and_one_in_use_never_is():
    m = Models()
    pool = m.pool({"a": MiB, "b": MiB, "c": MiB}, max_loaded=2)
    a = await pool.acquire("a")
    (await pool.acquire("b")).release()
    a.release()                                      # a was used after b: b is the least recent
    (await pool.acquire("c")).release()
    assert m.unloads == ["b"] and phases(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    held = await pool.acquire("a")
    m.busy.add("c")                                  # c's engine still runs a request (no lease)
    with pytest.raises(NoRoom) as e:
        await pool.acquire("b")
    assert "'b' needs 1 MiB" in e.value.message and "--max-loaded-models 2" in e.value.message
    assert e.value.retry_after and m.unloads == ["b"]
    m.busy.clear()
    held.release()
    (await pool.acquire("b")).release()              # now c (idle, least recent) goes
    assert m.unloads == ["b", "c"]


async def test_the_memory_budget_evicts_idle_models_and_refuses_one_that_can_never_fit():
    m = Models()
    pool = m.pool({"a": 60 * MiB, "b": 60 * MiB, "huge": 500 * MiB}, memory_budget=100 * MiB)
    (await pool.acquire("a")).release()
    (await pool.acquire("b")).release()              # 120 MiB > 100: a goes
    assert m.unloads == ["a"]
    with pytest.raises(NoRoom) as e:
        await pool.acquire("huge")
    assert e.value.needed_bytes == 500 * MiB and "500 MiB" in e.value.message and "100 MiB" in e.value.message
    assert m.unloads == ["a"]                        # nothing was evicted for a model that cannot fit


async def test_keep_alive_unloads_an_idle_model_and_a_request_may_override_it():
    m = Models()
    pool = m.pool({"a": MiB, "b": MiB}, keep_alive=0.0)
    lease = await pool.acquire("a")
    m.busy.add("a")
    lease.release()
    for _ in range(20):                               # running requests keep it loaded past its keep-alive
        await asyncio.sleep(0.01)
    assert phases(pool)["a"] == "loaded"
    m.busy.clear()
    await until(lambda: phases(pool)["a"] == "unloaded", "keep_alive 0 unloads once idle")
    (await pool.acquire("b", keep_alive=-1)).release()     # this request's keep_alive: never
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert phases(pool)["b"] == "loaded"
    (await pool.acquire("b", keep_alive=0)).release()
    await until(lambda: phases(pool)["b"] == "unloaded", "a request's keep_alive 0")
    (await pool.acquire("a", keep_alive=-1)).release()
    (await pool.acquire("a")).release()              # the last request's keep_alive counts: the default 0
    await until(lambda: phases(pool)["a"] == "unloaded", "a request without keep_alive: the default")


async def test_a_request_arriving_while_its_model_unloads_waits_and_reloads_it():
    m = Models()
    m.unload_gate = asyncio.Event()
    pool = m.pool({"a": MiB}, keep_alive=0.0)
    (await pool.acquire("a")).release()
    await until(lambda: phases(pool)["a"] == "unloading", "the unload started")
    late = asyncio.ensure_future(pool.acquire("a"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not late.done()                           # it waits for the unload, never gets a dying model
    m.unload_gate.set()
    lease = await late
    assert lease.value == "model:a" and m.loads == ["a", "a"] and m.unloads == ["a"]
    assert phases(pool)["a"] == "loaded"
    lease.release()
    await pool.close()


async def test_a_lease_dropped_without_release_is_given_back_when_collected():
    m = Models()
    pool = m.pool({"a": MiB, "b": MiB}, max_loaded=1)
    lease = await pool.acquire("a")
    assert [i.leases for i in pool.info()] == [1, 0]
    del lease                                        # a request parsed, then dropped unstreamed
    assert [i.leases for i in pool.info()] == [0, 0]
    (await pool.acquire("b")).release()              # so a is idle and makes room
    assert m.unloads == ["a"]


def kv_held(pool: ModelPool) -> dict[str, int]:
    return {i.name: i.kv_bytes for i in pool.info()}


async def test_the_kv_budget_is_shared_on_load_and_a_freed_share_goes_to_the_next_load():
    m = Models()
    pool = m.pool({"a": MiB, "b": MiB, "c": MiB}, max_loaded=2, kv_budget=100 * MiB)
    assert pool.kv_share("a") == 50 * MiB and pool.kv_free == 100 * MiB    # budget ÷ 2 slots
    (await pool.acquire("a", keep_alive=-1)).release()
    assert kv_held(pool) == {"a": 49 * MiB, "b": 0, "c": 0}                 # 7 whole 7 MiB blocks
    b = await pool.acquire("b")
    assert m.shares == [("a", 50 * MiB), ("b", 51 * MiB)]                   # a's rounding left over goes to b
    assert kv_held(pool) == {"a": 49 * MiB, "b": 49 * MiB, "c": 0}
    assert sum(kv_held(pool).values()) <= pool.kv_budget and pool.kv_free == 2 * MiB
    b.release()
    assert await pool.unload("b")                                            # keep_alive 0 does this
    assert kv_held(pool)["b"] == 0 and pool.kv_free == 51 * MiB               # its share went back
    (await pool.acquire("c")).release()
    assert m.shares[-1] == ("c", 51 * MiB)                                   # the third load gets it
    assert kv_held(pool) == {"a": 49 * MiB, "b": 0, "c": 49 * MiB}
    (await pool.acquire("b")).release()                                      # a (least recent idle) makes room
    assert m.unloads == ["b", "a"] and m.shares[-1] == ("b", 51 * MiB)
    assert sum(kv_held(pool).values()) <= pool.kv_budget


async def test_concurrent_loads_never_share_more_than_the_budget_and_a_failed_one_gives_its_share_back():
    m = Models()
    m.gate["a"], m.gate["b"] = asyncio.Event(), asyncio.Event()
    m.fail = {"b"}
    pool = m.pool({"a": MiB, "b": MiB, "c": MiB}, max_loaded=3, kv_budget=90 * MiB)
    la, lb = asyncio.ensure_future(pool.acquire("a")), asyncio.ensure_future(pool.acquire("b"))
    await until(lambda: len(m.loads) == 2, "both loads started")
    assert m.shares == [("a", 30 * MiB), ("b", 30 * MiB)]                   # each load's share is reserved
    assert pool.kv_free == 30 * MiB and kv_held(pool) == {"a": 30 * MiB, "b": 30 * MiB, "c": 0}
    m.gate["a"].set()
    m.gate["b"].set()
    (await la).release()
    with pytest.raises(LoadFailed):
        await lb
    assert kv_held(pool) == {"a": 28 * MiB, "b": 0, "c": 0}                  # b's reservation is free again
    (await pool.acquire("c")).release()
    assert m.shares[-1] == ("c", 31 * MiB)                                   # 62 MiB free ÷ 2 empty slots


async def test_without_a_shared_budget_each_load_sizes_its_own_cache():
    m = Models()
    pool = m.pool({"a": MiB, "b": MiB})
    (await pool.acquire("a")).release()
    assert m.shares == [("a", None)] and pool.kv_share("b") is None and kv_held(pool) == {"a": 0, "b": 0}
