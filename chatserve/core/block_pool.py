"""Physical KV blocks: ref counts, the hash → block map and the free queue (clean + two LRU tiers).

Knows nothing about sequences or tokens (that is kv_cache_manager.py) and holds no tensors (the
runner owns those); every operation here is O(1) per block.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from chatserve.core.prefix_hash import BlockHash


class BlockPool:
    """`num_blocks` physical blocks, each in exactly one of four places:

        used   ref > 0 (owned by one or more block tables; may hold a hash)
        clean  ref 0, no hash                      deque, head = next to allocate
        lru    ref 0, hash kept (evictable cache)  OrderedDict, head = least recently freed
        warm   ref 0, hash kept, protected tier    OrderedDict, evicted only when lru is empty

    The free queue is clean ‖ lru ‖ warm; allocation pops its head. A popped block that still holds
    a hash is evicted then (lazy eviction): its hash leaves the map only at reuse.

    max_warm bounds the warm tier (None = unbounded): past it, the oldest warm block is demoted to
    the lru tail (segmented LRU), so protected blocks can never crowd every other prefix out.
    """

    def __init__(self, num_blocks: int, max_warm: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if max_warm is not None and max_warm < 0:
            raise ValueError(f"max_warm must be >= 0, got {max_warm}")
        self.num_blocks = num_blocks
        self.max_warm = max_warm
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        self._clean: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._warm: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0
        self.warm_demotions = 0

    # ── counts ────────────────────────────────────────────────────────────────────────────────
    @property
    def num_free(self) -> int:
        """Blocks allocatable now: clean + evictable cached (both tiers)."""
        return len(self._clean) + len(self._lru) + len(self._warm)

    @property
    def num_clean(self) -> int:
        return len(self._clean)

    @property
    def num_cached(self) -> int:
        """Ref-0 blocks that still hold a hash (lru + warm)."""
        return len(self._lru) + len(self._warm)

    @property
    def num_warm(self) -> int:
        return len(self._warm)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def free_queue(self) -> list[int]:
        """The whole free queue, head first (for tests and debugging; O(n))."""
        return [*self._clean, *self._lru, *self._warm]

    # ── allocation ────────────────────────────────────────────────────────────────────────────
    def allocate(self) -> int:
        """Pop the head of the free queue, evicting its cached hash if any; ref becomes 1."""
        if self._clean:
            b = self._clean.popleft()
        else:
            if self._lru:
                b = self._lru.popitem(last=False)[0]
            elif self._warm:
                b = self._warm.popitem(last=False)[0]
            else:
                raise RuntimeError("BlockPool.allocate: no free blocks")
            h = self.block_hash[b]
            if h is not None:
                del self.hash_to_block[h]
                self.block_hash[b] = None
                self.evictions += 1
        self.ref_counts[b] = 1
        return b

    def take(self, block: int) -> None:
        """Add a reference (a prefix hit or a fork); a ref-0 cached block leaves the free queue."""
        if self.ref_counts[block] == 0:
            if block in self._lru:
                del self._lru[block]
            elif block in self._warm:
                del self._warm[block]
            else:
                raise AssertionError(f"block {block} has ref 0 but is not in a cached tier")
        self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int], keep_warm: bool = False) -> None:
        """Drop one reference on each block, in the given order. Blocks reaching ref 0 join the free
        queue: hashed ones at the tail of lru (or warm when keep_warm), unhashed ones at the head of
        clean (reused first). A warm tier over max_warm demotes its oldest blocks to the lru tail."""
        refs, hashes = self.ref_counts, self.block_hash
        tier = self._warm if keep_warm else self._lru
        cap = self.max_warm if keep_warm else None
        for b in blocks:
            r = refs[b] - 1
            if r < 0:
                raise AssertionError(f"block {b} released more often than taken")
            refs[b] = r
            if r == 0:
                if hashes[b] is None:
                    self._clean.appendleft(b)
                else:
                    tier[b] = None
                    if cap is not None and len(tier) > cap:
                        self._lru[tier.popitem(last=False)[0]] = None
                        self.warm_demotions += 1

    # ── hashes ────────────────────────────────────────────────────────────────────────────────
    def lookup(self, h: BlockHash) -> int | None:
        return self.hash_to_block.get(h)

    def register(self, block: int, h: BlockHash) -> bool:
        """Map h → block if neither is mapped yet (no dedup: an existing mapping wins)."""
        if self.block_hash[block] is not None or h in self.hash_to_block:
            return False
        self.block_hash[block] = h
        self.hash_to_block[h] = block
        return True

    def reset_hashes(self) -> bool:
        """Forget the hashes of every ref-0 block (they become clean, LRU order kept).
        True when no hash remains at all; False when live (ref > 0) blocks still hold some."""
        for tier in (self._lru, self._warm):
            for b in tier:
                h = self.block_hash[b]
                if h is not None:           # a block in the LRU tiers is hashed (free clean blocks are elsewhere)
                    del self.hash_to_block[h]
                self.block_hash[b] = None
                self._clean.append(b)
            tier.clear()
        return not self.hash_to_block

    # ── invariants ────────────────────────────────────────────────────────────────────────────
    def check_integrity(self) -> None:
        """Raise AssertionError if any pool invariant is broken (O(num_blocks))."""
        n = self.num_blocks
        clean, lru, warm = list(self._clean), list(self._lru), list(self._warm)
        free = clean + lru + warm
        assert len(set(free)) == len(free), f"a block is twice in the free queue: {free}"
        used = [b for b in range(n) if self.ref_counts[b] > 0]
        assert len(free) + len(used) == n, \
            f"free {len(clean)} + cached {len(lru) + len(warm)} + used {len(used)} != total {n}"
        for b in range(n):
            assert self.ref_counts[b] >= 0, f"block {b} has ref count {self.ref_counts[b]}"
        for b in free:
            assert self.ref_counts[b] == 0, f"block {b} is free but has ref {self.ref_counts[b]}"
        for b in clean:
            assert self.block_hash[b] is None, f"clean block {b} holds a hash"
        for b in lru + warm:
            assert self.block_hash[b] is not None, f"cached block {b} holds no hash"
        for b in range(n):
            h = self.block_hash[b]
            if h is not None:
                assert self.hash_to_block.get(h) == b, f"hashed block {b} not findable by its hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"map says {h.hex()} → {b}, block says otherwise"
