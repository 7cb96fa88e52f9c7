"""ModelPool (chatserve/engine/model_pool.py) with scripted loads: one load for concurrent requests, a
failed load told to every waiter and retried by the next request, LRU eviction of idle models under the
count and memory limits, a model in use never unloaded, keep-alive expiry, and a request that arrives
while its model is being unloaded. Loads and unloads are gated by events, so nothing depends on timing."""
from __future__ import annotations

import asyncio

import pytest

from chatserve.engine.model_pool import LoadFailed, ModelPool, NoRoom

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


class Models:
    """Scripted loader: `gate[name]` (when set) holds a load until released; `fail` names loads that raise;
    `busy` names models whose engines still run requests."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.gate: dict[str, asyncio.Event] = {}
        self.unload_gate: asyncio.Event | None = None
        self.fail: set[str] = set()
        self.busy: set[str] = set()

    async def load(self, name: str) -> str:
        self.loads.append(name)
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
                         sizes=sizes, **kw)


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
