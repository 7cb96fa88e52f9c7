"""KVCacheManager: exact block ids, prefix sharing, salts, CoW, watermark, eviction order, counters."""
import pytest

from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.outputs import CopyOp

@pytest.fixture(autouse=True)
def _check_every_manager(monkeypatch):
    """Autouse: every KVCacheManager built during a test gets check_integrity() at teardown."""
    made: list[KVCacheManager] = []
    orig = KVCacheManager.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(KVCacheManager, "__init__", init)
    yield
    for m in made:
        m.check_integrity()


def mgr(num_blocks=16, block_size=4, **kw) -> KVCacheManager:
    kw.setdefault("hash_seed", 0)
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_blocks, block_size, **kw)


def prefill(m: KVCacheManager, sid: str, toks: list[int], salt: str | None = None) -> int:
    """Scheduler-style prefill of a whole prompt; returns the cached token count."""
    hit = m.add_seq(sid, toks, cache_salt=salt)
    assert m.allocate_slots(sid, len(toks)) == []
    m.commit(sid, toks, len(toks))
    return hit


def decode(m: KVCacheManager, sid: str, toks: list[int], tok: int) -> list[CopyOp]:
    """Append one generated token: allocate its slot, 'run', commit."""
    toks.append(tok)
    ops = m.allocate_slots(sid, len(toks))
    assert ops is not None
    m.commit(sid, toks, len(toks))
    return ops


def test_exact_block_ids_through_a_request_lifecycle():
    m = mgr(8, 4)
    toks = [1, 2, 3, 4, 5, 6]
    assert m.add_seq("a", toks) == 0
    assert m.allocate_slots("a", 6) == []
    assert m.get_block_table("a") == [0, 1]
    m.commit("a", toks, 6)
    assert m.num_computed_tokens("a") == 6
    for t in (7, 8):
        decode(m, "a", toks, t)
    assert m.get_block_table("a") == [0, 1]
    decode(m, "a", toks, 9)                         # position 8 opens block 2
    assert m.get_block_table("a") == [0, 1, 2]
    s = m.stats()
    assert (s.used_blocks, s.free_blocks, s.cached_blocks) == (3, 5, 0)
    assert (s.allocated_slots, s.filled_slots) == (12, 9)
    m.free("a")
    s = m.stats()
    # blocks 0, 1 were full (hashed) → cache; block 2 was partial → clean head
    assert (s.used_blocks, s.free_blocks, s.cached_blocks) == (0, 6, 2)
    assert m.pool.free_queue() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert not m.has_seq("a")
    m.free("a")                                      # unknown ids are ignored


def test_same_64_token_prefix_shares_the_same_4_physical_blocks():
    m = mgr(32, 16)
    system = list(range(100, 164))                   # 64 tokens = 4 full blocks
    assert prefill(m, "a", system + [7, 8]) == 0
    assert prefill(m, "b", system + [9]) == 64
    ta, tb = m.get_block_table("a"), m.get_block_table("b")
    assert ta[:4] == tb[:4] == [0, 1, 2, 3]
    assert ta[4] != tb[4]
    assert all(m.pool.ref_counts[b] == 2 for b in ta[:4])
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (66 + 65, 64)
    assert s.used_blocks == 6


def test_identical_64_token_prompts_recompute_only_the_last_block():
    # The same exact 64-token prompt: the match is capped so the last token is computed (its
    # logits are needed). 3 blocks shared; the 4th is recomputed into a private block that
    # stays unregistered (no dedup) — so the next request still hits block 3 of "a".
    m = mgr(32, 16)
    p = list(range(64))
    prefill(m, "a", p)
    assert prefill(m, "b", p) == 48
    ta, tb = m.get_block_table("a"), m.get_block_table("b")
    assert ta == [0, 1, 2, 3] and tb == [0, 1, 2, 4]
    assert m.pool.block_hash[4] is None
    assert m.add_seq("c", p + [1]) == 64
    assert m.get_block_table("c") == [0, 1, 2, 3]


def test_different_salts_never_share_blocks():
    m = mgr(32, 16)
    p = list(range(64)) + [5]
    prefill(m, "a", p, salt="alice")
    assert prefill(m, "b", p, salt="bob") == 0
    assert prefill(m, "c", p) == 0                   # no salt ≠ any salt
    tables = [set(m.get_block_table(s)) for s in "abc"]
    assert tables[0].isdisjoint(tables[1]) and tables[0].isdisjoint(tables[2])
    assert tables[1].isdisjoint(tables[2])
    assert m.add_seq("d", p, cache_salt="alice") == 64
    assert m.get_block_table("d") == m.get_block_table("a")[:4]


def test_model_key_is_part_of_the_hash():
    a, b = mgr(8, 4, model_key="m1"), mgr(8, 4, model_key="m2")
    prefill(a, "x", [1, 2, 3, 4, 5])
    prefill(b, "x", [1, 2, 3, 4, 5])
    assert set(a.pool.hash_to_block).isdisjoint(b.pool.hash_to_block)


def test_generated_tokens_are_hashed_so_the_next_turn_hits():
    m = mgr(16, 4)
    turn1 = [1, 2, 3, 4, 5]
    prefill(m, "t1", turn1)
    for t in (6, 7, 8, 9, 10):
        decode(m, "t1", turn1, t)                   # 10 tokens: blocks 0,1 full
    m.free("t1", keep_warm=True)
    assert turn1 == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    turn2 = turn1 + [11, 12, 13]                    # history + new user message
    assert m.add_seq("t2", turn2) == 8              # block 1 = [5, 6, 7, 8]: 3 generated tokens
    assert m.get_block_table("t2") == [0, 1]


def test_fork_then_write_copies_on_write():
    m = mgr(16, 4)
    toks = [1, 2, 3, 4, 5, 6]                        # block 1 half full
    prefill(m, "p", toks)
    m.fork("p", "c")
    assert m.get_block_table("c") == [0, 1]
    assert m.pool.ref_counts[:2] == [2, 2]
    assert m.num_computed_tokens("c") == 6
    ops = decode(m, "p", toks, 7)                   # p writes into shared block 1 → copy
    assert ops == [CopyOp(src=1, dst=2)]
    assert m.get_block_table("p") == [0, 2]
    assert m.pool.ref_counts[:3] == [2, 1, 1]
    ctoks = toks[:6]
    assert decode(m, "c", ctoks, 8) == []           # c is now the only owner of block 1
    assert m.get_block_table("c") == [0, 1]
    assert m.stats().cow_copies == 1


def test_fork_at_a_block_boundary_needs_no_copy():
    m = mgr(16, 4)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    prefill(m, "p", toks)
    m.fork("p", "c")
    assert decode(m, "p", toks, 9) == []
    assert decode(m, "c", toks[:8], 9) == []
    assert m.get_block_table("p") == [0, 1, 2] and m.get_block_table("c") == [0, 1, 3]
    assert m.stats().cow_copies == 0


def test_fork_shares_preallocated_empty_blocks_then_swaps_without_copy():
    m = mgr(16, 4)
    toks = [1, 2, 3, 4]
    m.add_seq("p", toks)
    assert m.allocate_slots("p", 12) == []           # allocated ahead: blocks 0,1,2
    m.commit("p", toks, 4)
    m.fork("p", "c")
    assert m.pool.ref_counts[:3] == [2, 2, 2]
    assert m.allocate_slots("p", 9) == []            # blocks 1,2 hold nothing for p: no copy
    assert m.get_block_table("p") == [0, 3, 4]
    assert m.pool.ref_counts[:5] == [2, 1, 1, 1, 1]


def test_fork_revokes_write_grants():
    m = mgr(16, 4)
    toks = [1, 2, 3, 4, 5, 6]
    m.add_seq("p", toks)
    m.allocate_slots("p", 6)
    m.fork("p", "c")                                 # p has not committed yet: its grant is gone
    with pytest.raises(ValueError, match="allocate_slots"):
        m.commit("p", toks, 6)
    assert m.allocate_slots("p", 6) == []            # nothing computed yet: swap, no copy
    m.commit("p", toks, 6)


def test_fork_errors():
    m = mgr(8, 4)
    m.add_seq("p", [1])
    with pytest.raises(ValueError):
        m.fork("p", "p")
    with pytest.raises(KeyError):
        m.fork("nope", "x")
    with pytest.raises(ValueError):
        m.add_seq("p", [1])


def test_allocation_failure_changes_nothing():
    m = mgr(4, 4)
    m.add_seq("a", list(range(10)))
    assert m.allocate_slots("a", 10) == []           # 3 blocks
    m.commit("a", list(range(10)), 10)
    m.fork("a", "b")
    before = (m.get_block_table("a"), m.num_free_blocks, m.stats())
    # a needs 2 new blocks (CoW of block 2 + block 3) but only 1 is free
    assert not m.can_allocate("a", 13)
    assert m.allocate_slots("a", 13) is None
    assert (m.get_block_table("a"), m.num_free_blocks, m.stats()) == before
    assert m.can_allocate("a", 11)
    assert m.allocate_slots("a", 11) == [CopyOp(src=2, dst=3)]


def test_watermark_reserve():
    m = mgr(100, 4, watermark=0.05)                  # keeps ceil(5.0) = 5 blocks for growth
    assert m.watermark_blocks == 5
    m.add_seq("a", [0] * 380)
    assert m.can_allocate("a", 380, reserve_watermark=True)        # 95 blocks, 5 left: ok
    assert not m.can_allocate("a", 381, reserve_watermark=True)    # 96 blocks, 4 left
    assert m.can_allocate("a", 381)
    assert m.allocate_slots("a", 381, reserve_watermark=True) is None
    assert m.allocate_slots("a", 380, reserve_watermark=True) == []
    assert m.num_free_blocks == 5
    m.add_seq("b", [1])
    assert m.allocate_slots("b", 1, reserve_watermark=True) is None   # admission blocked
    assert m.allocate_slots("b", 1) == []            # a running seq may dip into the reserve


def test_commit_bounds():
    m = mgr(8, 4)
    toks = [1, 2, 3, 4, 5]
    m.add_seq("a", toks)
    m.allocate_slots("a", 5)
    with pytest.raises(ValueError):
        m.commit("a", toks, 6)                       # past the grant
    with pytest.raises(ValueError):
        m.commit("a", toks[:3], 4)                   # too few token ids
    m.commit("a", toks, 3)                           # chunked prefill
    m.commit("a", toks, 5)
    with pytest.raises(ValueError):
        m.commit("a", toks, 4)                       # backwards


def test_chunked_prefill_hashes_blocks_as_they_fill():
    m = mgr(8, 4)
    toks = list(range(10))
    m.add_seq("a", toks)
    m.allocate_slots("a", 3)
    m.commit("a", toks, 3)
    assert m.pool.hash_to_block == {}
    m.allocate_slots("a", 9)
    m.commit("a", toks, 9)
    assert sorted(m.pool.hash_to_block.values()) == [0, 1]
    assert m.allocate_slots("a", 10) == []
    m.commit("a", toks, 10)


def test_free_returns_chains_tail_first_so_heads_survive_eviction():
    m = mgr(6, 4)
    p = list(range(16))                              # 4 full blocks
    prefill(m, "a", p + [99])                        # blocks 0..3 hashed, 4 partial
    m.free("a")
    assert m.pool.free_queue() == [4, 5, 3, 2, 1, 0]
    # a 3-block request uses the clean blocks, then evicts the chain's tail (block 3)
    m.add_seq("b", [7] * 12)
    m.allocate_slots("b", 12)
    assert m.get_block_table("b") == [4, 5, 3]
    assert m.stats().evictions == 1
    # the head of the chain still hits
    assert m.add_seq("c", p[:12] + [1]) == 12
    assert m.get_block_table("c") == [0, 1, 2]


def test_keep_warm_tier_survives_pressure():
    m = mgr(6, 4)
    chat = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefill(m, "chat", chat)
    m.free("chat", keep_warm=True)                   # blocks 0,1 warm; block 2 clean
    oneshot = [50, 51, 52, 53, 54]
    prefill(m, "one", oneshot)                       # blocks 2, 3; block 2 hashed
    m.free("one")
    m.add_seq("big", [9] * 12)
    assert m.allocate_slots("big", 12) == []         # takes 3, 4, 5 (clean) first
    m.free("big")
    m.add_seq("big2", [8] * 16)
    assert m.allocate_slots("big2", 16) == []        # 4 blocks: clean ×3 then the lru block 2
    assert m.add_seq("chat2", chat + [10]) == 8      # the warm chat history still hits
    assert m.stats().evictions == 1


def test_reset_prefix_cache():
    m = mgr(8, 4)
    prefill(m, "a", [1, 2, 3, 4, 5])
    prefill(m, "b", [9, 9, 9, 9, 9])
    m.free("a")
    assert m.reset_prefix_cache() is False          # b still holds a hashed block
    assert m.add_seq("a2", [1, 2, 3, 4, 5]) == 0
    m.free("a2")
    m.free("b")
    assert m.reset_prefix_cache() is True
    assert m.stats().cached_blocks == 0
    assert m.add_seq("b2", [9, 9, 9, 9, 9]) == 0


def test_prefix_caching_disabled():
    m = mgr(8, 4, enable_prefix_caching=False)
    assert prefill(m, "a", [1, 2, 3, 4, 5]) == 0
    m.free("a")
    assert prefill(m, "b", [1, 2, 3, 4, 5]) == 0
    assert m.pool.hash_to_block == {}
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits, s.cached_blocks) == (0, 0, 0)


def test_prompt_shorter_than_a_block_and_empty_prompt():
    m = mgr(8, 4)
    assert prefill(m, "a", [1, 2]) == 0
    assert m.add_seq("e", []) == 0
    assert m.allocate_slots("e", 0) == []
    assert m.get_block_table("e") == []


@pytest.mark.parametrize("bs", [8, 16, 32])
def test_block_sizes(bs):
    m = mgr(64, bs)
    p = list(range(3 * bs + 2))
    prefill(m, "a", p)
    assert len(m.get_block_table("a")) == 4
    assert prefill(m, "b", p) == 3 * bs
    assert m.get_block_table("b")[:3] == m.get_block_table("a")[:3]


def test_usage_and_stats():
    m = mgr(10, 4)
    prefill(m, "a", list(range(9)))
    assert m.usage == pytest.approx(0.3)
    s = m.stats()
    assert s.usage == pytest.approx(0.3) and s.num_blocks == 10
    assert s.free_blocks + s.cached_blocks + s.used_blocks == 10
    assert s.waste_slots == 3
    assert m.num_free_blocks == 7


def test_check_integrity_catches_two_writers_and_bad_refs():
    m = mgr(8, 4)
    toks = [1, 2, 3, 4, 5, 6]
    prefill(m, "p", toks)
    m.fork("p", "c")
    m.check_integrity()
    m._seqs["c"].granted = 8                         # pretend c may write the shared block 1
    with pytest.raises(AssertionError, match="may write block 1"):
        m.check_integrity()
    m._seqs["c"].granted = 6
    m.pool.ref_counts[0] += 1
    with pytest.raises(AssertionError, match="held by 2 tables"):
        m.check_integrity()
    m.pool.ref_counts[0] -= 1



def test_sliding_window_releases_blocks_that_left_every_window():
    # block size 4, window 6: after computing c tokens, positions <= c - 6 are never read again
    m = mgr(num_blocks=8, sliding_window=6)
    toks = list(range(10))
    prefill(m, "a", toks)                              # c = 10: positions 0..4 out → block 0 (0..3) goes
    t = m.get_block_table("a")
    assert m.window_drops == 1 and m.num_free_blocks == 8 - 2
    assert t[0] == t[1] and len(t) == 3                # the dropped entry points at a live block
    for tok in range(10, 14):                          # c = 14: positions 0..8 out → block 1 goes too
        decode(m, "a", toks, tok)
    assert m.window_drops == 2 and m.num_free_blocks == 8 - 2
    assert m.stats().allocated_slots == 2 * 4
    m.free("a")
    assert m.num_free_blocks == 8


def test_sliding_window_dropped_blocks_still_serve_prefix_hits():
    m = mgr(num_blocks=8, sliding_window=6)
    toks = list(range(13))
    prefill(m, "a", toks)                              # drops block 0 (hashed, stays cached)
    m.free("a")
    assert prefill(m, "b", list(range(13))) == 12      # the whole chain matches again
    assert m.window_drops == 4                         # a and b each dropped blocks 0 and 1


def test_without_a_window_nothing_is_dropped():
    m = mgr(num_blocks=8)
    toks = list(range(30))
    prefill(m, "a", toks)
    assert m.window_drops == 0 and len(set(m.get_block_table("a"))) == 8
