"""BlockPool: exact allocation order, tail-first LRU, lazy eviction, the warm tier, invariants."""
import pytest

from chatserve.core.block_pool import BlockPool


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def pool():
    p = BlockPool(6)
    yield p
    p.check_integrity()


def test_fresh_pool_allocates_in_id_order(pool):
    assert [pool.allocate() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    assert pool.num_free == 0 and pool.num_used == 6
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.release([5, 4, 3, 2, 1, 0])


def test_unhashed_blocks_return_to_the_head(pool):
    a = [pool.allocate() for _ in range(3)]        # 0 1 2
    pool.release(reversed(a))                      # 2, 1, 0 each pushed on the head
    assert pool.free_queue() == [0, 1, 2, 3, 4, 5]
    assert pool.allocate() == 0
    pool.release([0])


def test_hashed_blocks_join_lru_tail_in_release_order_and_evict_lazily(pool):
    blocks = [pool.allocate() for _ in range(6)]
    for b in blocks[:3]:
        assert pool.register(b, h(b))
    pool.release([2, 1, 0])                        # a chain 0→1→2 released tail first
    assert pool.free_queue() == [2, 1, 0]
    assert pool.num_cached == 3 and pool.num_clean == 0
    # Lazy: still findable while free.
    assert pool.lookup(h(2)) == 2
    assert pool.allocate() == 2                    # the chain's tail is evicted first
    assert pool.evictions == 1
    assert pool.lookup(h(2)) is None and pool.block_hash[2] is None
    assert pool.lookup(h(0)) == 0 and pool.lookup(h(1)) == 1
    pool.release([2, 5, 4, 3])                     # unhashed → clean head, ahead of the cache
    assert pool.free_queue() == [3, 4, 5, 2, 1, 0]
    assert [pool.allocate() for _ in range(5)] == [3, 4, 5, 2, 1]
    assert pool.evictions == 2
    pool.release([1, 2, 5, 4, 3])


def test_take_pulls_a_cached_block_out_of_the_free_queue(pool):
    a = [pool.allocate() for _ in range(2)]
    pool.register(a[0], h(10))
    pool.release(reversed(a))
    assert pool.free_queue() == [1, 2, 3, 4, 5, 0]
    pool.take(0)                                   # a prefix hit on the cached block
    assert pool.ref_counts[0] == 1 and 0 not in pool.free_queue()
    pool.take(0)
    assert pool.ref_counts[0] == 2
    pool.release([0, 0])
    assert pool.free_queue() == [1, 2, 3, 4, 5, 0]


def test_warm_tier_is_evicted_only_after_the_normal_tier(pool):
    blocks = [pool.allocate() for _ in range(6)]
    for b in blocks:
        pool.register(b, h(b))
    pool.release([1, 0], keep_warm=True)           # a live chat's history
    pool.release([3, 2])                           # a finished one-shot request
    assert pool.num_warm == 2
    assert [pool.allocate() for _ in range(3)] == [3, 2, 1]
    assert pool.lookup(h(0)) == 0 and pool.evictions == 3
    pool.release([1, 2, 3, 4, 5])
    # warm blocks can still be hit, and leave the warm tier then
    pool.take(0)
    assert pool.num_warm == 0
    pool.release([0])


def test_register_never_dedups(pool):
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, h(1))
    assert not pool.register(b, h(1))              # hash already maps to a
    assert not pool.register(a, h(2))              # a already has a hash
    assert pool.lookup(h(1)) == a and pool.block_hash[b] is None
    pool.release([b, a])


def test_reset_hashes(pool):
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, h(1))
    pool.register(b, h(2))
    pool.release([a])
    assert pool.reset_hashes() is False            # b is live and keeps its hash
    assert pool.lookup(h(1)) is None and pool.lookup(h(2)) == b
    assert pool.num_cached == 0
    pool.release([b])
    assert pool.reset_hashes() is True
    assert pool.hash_to_block == {} and pool.num_clean == 6


def test_check_integrity_catches_corruption():
    p = BlockPool(4)
    b = p.allocate()
    p.check_integrity()
    p.ref_counts[b] = 0                            # referenced nowhere, yet not free
    with pytest.raises(AssertionError, match="total"):
        p.check_integrity()
    p.ref_counts[b] = 1
    p.block_hash[b] = h(3)                         # hashed but not findable
    with pytest.raises(AssertionError, match="findable"):
        p.check_integrity()
    p.block_hash[b] = None
    p._clean.append(b)                             # free and referenced
    with pytest.raises(AssertionError):
        p.check_integrity()


def test_release_below_zero_raises():
    p = BlockPool(2)
    with pytest.raises(AssertionError):
        p.release([0])
