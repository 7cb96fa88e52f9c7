"""`chatserve bench sessions`: keep_warm raises turn N+1's prefix hits under background load, the warm
tier's bound (max_warm_fraction) holds, and the CLI prints the figures. Real Scheduler + KVCacheManager.
"""
from __future__ import annotations

import json

from chatserve.bench import sessions
from chatserve.bench.sessions import Workload, default_cache_sizes, simulate
from chatserve.cli import BENCH
from chatserve.core.block_pool import BlockPool
from chatserve.core.kv_cache_manager import KVCacheManager

SMALL = Workload(sessions=4, turns=3, think_steps=(40, 80), bg_concurrency=6, bg_prefixes=8)


def test_keep_warm_gives_turn_n_plus_1_strictly_more_hits_under_load():
    n = default_cache_sizes(SMALL)[-1]
    off = simulate(SMALL, n, keep_warm=False)
    on = simulate(SMALL, n, keep_warm=True)
    for r in (off, on):
        assert r["completed"] and r["turns_measured"] == SMALL.sessions * (SMALL.turns - 1)
        assert r["bg_requests"] > 50                  # the background really ran
        assert 0.0 <= r["session_hit_frac"] <= r["session_cacheable_frac"] <= 1.0
    # the background flushes idle sessions from the plain LRU cache ...
    assert off["session_hit_frac"] < 0.2
    # ... but protected histories survive: strictly (and here much) higher, near the ceiling
    assert on["session_hit_frac"] > off["session_hit_frac"] + 0.4
    assert on["session_hit_frac"] >= 0.9 * on["session_cacheable_frac"]
    # the cost is paid by the background's own prefix hits, never by refusing memory
    assert on["bg_hit_frac"] <= off["bg_hit_frac"]
    assert on["preemptions"] <= off["preemptions"] + 2


def test_more_cache_more_turn_n_plus_1_hits_with_keep_warm():
    sizes = default_cache_sizes(SMALL)
    hits = [simulate(SMALL, n, keep_warm=True)["session_hit_frac"] for n in sizes]
    assert hits == sorted(hits) and hits[-1] > hits[0]


def test_runs_are_reproducible():
    n = default_cache_sizes(SMALL)[1]
    assert simulate(SMALL, n, True) == simulate(SMALL, n, True)


def test_warm_tier_bound_demotes_oldest_to_lru_tail():
    pool = BlockPool(8, max_warm=2)
    blocks = [pool.allocate() for _ in range(5)]
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]) * 16)
    pool.release([blocks[0]])                       # a one-shot request's block: lru
    pool.release([blocks[4], blocks[3], blocks[2], blocks[1]], keep_warm=True)   # tail first
    assert pool.num_warm == 2 and pool.warm_demotions == 2
    # clean ‖ lru ‖ warm: warm keeps the two last freed (the chain head); 4 and 3 joined the lru tail
    assert pool.free_queue()[3:] == [blocks[0], blocks[4], blocks[3], blocks[2], blocks[1]]
    pool.check_integrity()
    # all still cached and findable; the lru (incl. demoted) goes first, warm last
    assert all(pool.lookup(bytes([i]) * 16) == b for i, b in enumerate(blocks))


def test_manager_bounds_the_warm_tier_by_default():
    m = KVCacheManager(10, 4)
    assert m.max_warm_fraction == 0.5 and m.pool.max_warm == 5
    for k in range(3):                               # three chats of 3 full blocks + 1 partial
        sid = f"c{k}"
        toks = list(range(100 * k, 100 * k + 13))
        m.add_seq(sid, toks)
        assert m.allocate_slots(sid, 13) is not None
        m.commit(sid, toks, 13)
        m.free(sid, keep_warm=True)
        m.check_integrity()
    assert m.pool.num_warm == 5 and m.pool.num_cached == 9
    assert KVCacheManager(10, 4, max_warm_fraction=1.0).pool.max_warm == 10


def test_unbounded_warm_tier_costs_background_hits_in_many_idle_sessions():
    w = Workload(sessions=32, turns=2, think_steps=(300, 500), bg_concurrency=6, bg_prefixes=8)
    n = 2 * default_cache_sizes(SMALL)[-1]
    off = simulate(w, n, False)
    nocap = simulate(w, n, True, max_warm_fraction=1.0)
    capped = simulate(w, n, True)
    assert nocap["bg_hit_frac"] < off["bg_hit_frac"]
    assert nocap["bg_hit_frac"] <= capped["bg_hit_frac"] <= off["bg_hit_frac"]
    assert capped["max_warm_blocks"] == n // 2 and nocap["max_warm_blocks"] == n


def test_cli_json(capsys):
    assert BENCH["sessions"] == "chatserve.bench.sessions:main"
    rc = sessions.main(["--json", "--sessions", "2", "--turns", "2", "--think-steps", "20,40",
                        "--bg-concurrency", "4", "--cache-sizes", "120,200"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["num_blocks"], r["keep_warm"]) for r in res["rows"]] == \
        [(120, False), (120, True), (200, False), (200, True)]
    assert len(res["starvation"]) == 3 and res["config"]["date"]
    assert sessions.main(["--sessions", "2", "--turns", "2", "--no-starvation",
                          "--cache-sizes", "150"]) == 0
    assert "keep_warm" in capsys.readouterr().out
