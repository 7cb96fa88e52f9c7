"""Per-sequence block tables over a BlockPool: prefix match, allocate, commit (hash), fork, CoW, free.

Pure bookkeeping in plain ints and lists: it never touches KV tensors. Copy-on-write only records
`CopyOp(src, dst)`; the runner executes a step's copies in one batched call. See docs/kv-cache.md.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from chatserve.core.block_pool import BlockPool
from chatserve.core.outputs import CopyOp
from chatserve.core.prefix_hash import ROOT_HASH, BlockHash, PrefixHasher

# Slot mapping (block_size 4 shown). Position p of a sequence lives in
# physical block table[p // block_size] at offset p % block_size:
#
#   positions   0 1 2 3 | 4 5 6 7 | 8 9 . .        computed = 10, granted = 12
#   table       [  7    ,    2    ,    9   ]       block 9 = the "write block" (holds position 10)
#               full,hashed full,hashed partial → must have ref 1 before anything writes into it
#
# Write grant: allocate_slots(seq, n) makes every block covering positions [computed, n) exclusive
# (ref 1, copy-on-write if shared) and sets granted = n. commit() may only advance computed up to
# granted. fork() revokes the grant of both parent and child (granted = computed), so neither may
# write again before its next allocate_slots, which performs the CoW. check_integrity() verifies
# that every block covering [computed, granted) of every live sequence has ref 1 — so no two live
# sequences can ever write the same block.
#
# Sliding window (every layer attends to at most the last W positions): once the next position to
# compute is c, keys at positions <= c - W are never read again, so a block whose last position is
# <= c - W leaves the table (its entry becomes DROPPED, the block is released like a freed one and
# stays findable by hash). Block size 4, W = 6, computed = 11:
#
#   positions   0 1 2 3 | 4 5 6 7 | 8 9 10 .     positions <= 5 are out of every window
#   table       [DROPPED, 2       , 9       ]    block 2 holds 6, 7: still visible


@dataclass
class KVCacheStats:
    num_blocks: int
    free_blocks: int             # ref 0, no hash
    used_blocks: int             # ref > 0
    cached_blocks: int           # ref 0 but holds a hash (evictable)
    usage: float                 # used_blocks / num_blocks (0..1)
    prefix_queries: int          # tokens looked up (sum of len(token_ids) passed to add_seq)
    prefix_hits: int             # tokens served from cache
    evictions: int
    cow_copies: int
    allocated_slots: int         # Σ over live seqs of len(block_table) * block_size
    filled_slots: int            # Σ over live seqs of computed tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def waste_slots(self) -> int:
        return self.allocated_slots - self.filled_slots


DROPPED = -1         # a table entry whose block slid out of the window (never read again)


class _SeqBlocks:
    """One sequence's block table, how far it is computed and granted, and its block hash chain."""

    __slots__ = ("table", "computed", "granted", "hashes", "extra", "shared_extra", "shared_blocks")

    def __init__(self, extra: bytes, shared_extra: bytes = b"", shared_blocks: int = 0) -> None:
        self.table: list[int] = []
        self.computed = 0            # positions [0, computed) hold K/V
        self.granted = 0             # positions [computed, granted) may be written (exclusive blocks)
        self.hashes: list[BlockHash] = []   # chained hash of each full block (prefix caching only)
        self.extra = extra           # digest of (cache_salt, model_key)
        self.shared_extra = shared_extra    # digest of (no salt, model_key): the shared-prefix blocks
        self.shared_blocks = shared_blocks  # leading full blocks hashed with shared_extra


class KVCacheManager:
    """Block tables for every live sequence, backed by one BlockPool. Not thread-safe: the
    scheduler owns it and calls it from one thread."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, hash_seed: int | None = None, model_key: str = "",
                 max_warm_fraction: float | None = 0.5, sliding_window: int | None = None) -> None:
        """sliding_window: the model reads at most this many past positions in every layer
        (ArchConfig.kv_window); blocks that slide out are released. None keeps every block."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if max_warm_fraction is not None and not 0.0 <= max_warm_fraction <= 1.0:
            raise ValueError(f"max_warm_fraction must be in [0, 1], got {max_warm_fraction}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.watermark_blocks = math.ceil(watermark * num_blocks)
        self.model_key = model_key
        # keep_warm blocks beyond this share of the cache are demoted to the normal LRU tier
        self.max_warm_fraction = max_warm_fraction
        self.pool = BlockPool(num_blocks, None if max_warm_fraction is None
                              else int(max_warm_fraction * num_blocks))
        self.hasher = PrefixHasher(block_size, hash_seed)
        self._seqs: dict[str, _SeqBlocks] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.cow_copies = 0
        self.window_drops = 0          # blocks released because they slid out of the window

    # ── counts ────────────────────────────────────────────────────────────────────────────────
    @property
    def num_free_blocks(self) -> int:
        """Allocatable now: clean free blocks + evictable cached blocks."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: str) -> list[int]:
        """A copy of the seq's block table (safe to hand to the runner). Entries that slid out of the
        window hold the first live block instead: attention never reads them, and every entry stays a
        valid block id."""
        t = self._seqs[seq_id].table
        if not t or t[0] != DROPPED:
            return list(t)
        live = next((b for b in t if b != DROPPED), 0)
        return [live if b == DROPPED else b for b in t]

    def num_computed_tokens(self, seq_id: str) -> int:
        return self._seqs[seq_id].computed

    def num_allocated_slots(self, seq_id: str) -> int:
        """Slots the seq's table covers (len(block_table) * block_size), without copying the table."""
        return len(self._seqs[seq_id].table) * self.block_size

    # ── lifecycle ─────────────────────────────────────────────────────────────────────────────
    def add_seq(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None,
                shared_prefix_tokens: int = 0, *, match_prefix: bool = True) -> int:
        """Register a sequence and take refs on its longest cached chain of full blocks.

        The match is capped so at least one token remains to compute. Returns the number of cached
        tokens (a multiple of block_size); the seq's computed count starts there.

        shared_prefix_tokens: the first tokens are an operator-marked shared prefix (a system prompt
        shared across owners). Blocks lying entirely inside it are hashed without the cache salt, so
        every owner shares them; later blocks keep the salt (the chain still isolates owners).
        match_prefix=False: take no hit (a prompt-logprobs request needs every position's logits);
        its blocks are still hashed at commit for later requests."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        shared_blocks = max(0, int(shared_prefix_tokens)) // self.block_size if cache_salt else 0
        seq = _SeqBlocks(self.hasher.extra_key(cache_salt, self.model_key),
                   self.hasher.extra_key(None, self.model_key) if shared_blocks else b"", shared_blocks)
        self._seqs[seq_id] = seq
        if not self.enable_prefix_caching or not match_prefix:
            return 0
        bs = self.block_size
        n = len(token_ids)
        max_blocks = (n - 1) // bs if n > 0 else 0
        table, hashes = seq.table, seq.hashes
        if max_blocks and self.pool.hash_to_block:
            lookup = self.pool.hash_to_block.get
            for h in self._block_hashes(seq, token_ids, ROOT_HASH, 0, max_blocks):
                b = lookup(h)
                if b is None:
                    break
                table.append(b)
                hashes.append(h)
            refs, take = self.pool.ref_counts, self.pool.take
            for b in table:                     # (all live: the window drops come at commit)
                if refs[b]:
                    refs[b] += 1                # live block: just one more owner
                else:
                    take(b)                     # cached block: leaves the free queue
        hits = len(table) * bs
        seq.computed = seq.granted = hits
        self.prefix_queries += n
        self.prefix_hits += hits
        if self.sliding_window is not None:
            self._drop_out_of_window(seq, self.sliding_window)
        return hits

    def _plan(self, seq: _SeqBlocks, num_tokens: int) -> tuple[int, list[int]]:
        """(new blocks to append, table indices to copy-on-write) for covering num_tokens slots."""
        bs = self.block_size
        table = seq.table
        need = -(-num_tokens // bs) - len(table)
        cow: list[int] = []
        c = seq.computed
        if num_tokens > c:
            refs = self.pool.ref_counts
            last = min(len(table), -(-num_tokens // bs))
            for j in range(c // bs, last):
                if refs[table[j]] > 1:
                    cow.append(j)
        return (need if need > 0 else 0), cow

    def _fits(self, num_needed: int, reserve_watermark: bool) -> bool:
        free = self.pool.num_free - num_needed
        if free < 0:
            return False
        return not reserve_watermark or free >= self.watermark_blocks

    def can_allocate(self, seq_id: str, num_tokens: int, *, reserve_watermark: bool = False) -> bool:
        seq = self._seqs[seq_id]
        if num_tokens <= seq.granted:
            return True
        need, cow = self._plan(seq, num_tokens)
        return self._fits(need + len(cow), reserve_watermark)

    def allocate_slots(self, seq_id: str, num_tokens: int, *,
                       reserve_watermark: bool = False) -> list[CopyOp] | None:
        """Make the table cover num_tokens slots and grant writes to [computed, num_tokens).

        Shared blocks in that range are copied on write: a fresh block replaces the shared one
        (which loses one ref) and CopyOp(src=old, dst=new) is recorded when the old block holds
        positions this seq has computed. Returns the CopyOps, or None (nothing changed) if there
        are not enough free blocks — or, with reserve_watermark, if fewer than
        ceil(watermark * num_blocks) would remain."""
        seq = self._seqs[seq_id]
        if num_tokens <= seq.granted:           # fast path: already covered and exclusive
            return []
        c = seq.computed
        if num_tokens == c + 1:                 # fast path: one decode token at position c
            table = seq.table
            j = c // self.block_size
            if j < len(table):
                if self.pool.ref_counts[table[j]] == 1:
                    seq.granted = num_tokens
                    return []
            elif j == len(table) and self._fits(1, reserve_watermark):
                table.append(self.pool.allocate())
                seq.granted = num_tokens
                return []
        need, cow = self._plan(seq, num_tokens)
        if not self._fits(need + len(cow), reserve_watermark):
            return None
        pool, table = self.pool, seq.table
        ops: list[CopyOp] = []
        if cow:
            bs = self.block_size
            refs = pool.ref_counts
            for j in cow:
                old = table[j]
                new = pool.allocate()
                refs[old] -= 1                  # was > 1, so it stays owned by someone else
                table[j] = new
                if j * bs < c:                  # old holds positions we computed: copy them
                    ops.append(CopyOp(src=old, dst=new))
            self.cow_copies += len(ops)
        for _ in range(need):
            table.append(pool.allocate())
        seq.granted = num_tokens
        return ops

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
               shared_prefix_tokens: int | None = None) -> None:
        """Positions [0, num_computed) now hold K/V: hash and register every block that became full.

        token_ids are the seq's tokens (prompt + generated), at least num_computed of them. If a
        block's hash already maps to another block, ours stays unregistered (no dedup). Raises
        ValueError when num_computed goes backwards or past the slots granted by allocate_slots.
        shared_prefix_tokens: None keeps what add_seq registered; an int changes it for the blocks
        not hashed yet (blocks inside it are hashed without the salt, see add_seq)."""
        seq = self._seqs[seq_id]
        if shared_prefix_tokens is not None:
            seq.shared_blocks = max(0, int(shared_prefix_tokens)) // self.block_size
            if seq.shared_blocks and not seq.shared_extra:
                seq.shared_extra = self.hasher.extra_key(None, self.model_key)
        if num_computed > seq.granted or num_computed < seq.computed:
            raise ValueError(f"commit({seq_id!r}, {num_computed}): must lie in [computed "
                             f"{seq.computed}, granted {seq.granted}] (call allocate_slots first)")
        if len(token_ids) < num_computed:
            raise ValueError(f"commit({seq_id!r}): {len(token_ids)} token ids < {num_computed}")
        seq.computed = num_computed
        if self.enable_prefix_caching:
            self._hash_full_blocks(seq, token_ids, num_computed)
        if self.sliding_window is not None:
            self._drop_out_of_window(seq, self.sliding_window)

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """Give back the blocks wholly past the first num_tokens slots, and the write grant past them
        (slots a speculative step granted to drafts that were rejected). Never drops a computed
        position: num_tokens is raised to computed. Those blocks hold no hash (they lie past computed),
        so they return to the clean free queue. Returns the number of blocks released."""
        seq = self._seqs[seq_id]
        keep = -(-max(num_tokens, seq.computed) // self.block_size)
        extra = seq.table[keep:]
        if not extra:
            return 0
        del seq.table[keep:]
        seq.granted = min(seq.granted, keep * self.block_size)
        self.pool.release(reversed(extra), False)
        return len(extra)

    def _hash_full_blocks(self, seq: _SeqBlocks, token_ids: Sequence[int], num_computed: int) -> None:
        bs = self.block_size
        full = num_computed // bs
        hashes = seq.hashes
        k = len(hashes)
        if full <= k:
            return
        register, table = self.pool.register, seq.table
        for j, h in enumerate(self._block_hashes(seq, token_ids, hashes[-1] if k else ROOT_HASH, k, full),
                              start=k):
            hashes.append(h)
            register(table[j], h)          # a hash already mapped to another block stays there (no dedup)

    def _block_hashes(self, seq: _SeqBlocks, token_ids: Sequence[int], parent: BlockHash, start: int,
                      end: int) -> Iterator[BlockHash]:
        """The chain of blocks start..end-1: the shared-prefix blocks hashed without the salt, the
        rest with it (see add_seq)."""
        hasher = self.hasher
        if start < seq.shared_blocks:
            shared_end = min(end, seq.shared_blocks)
            for parent in hasher.iter_hashes(token_ids, seq.shared_extra, parent, start, shared_end - start):
                yield parent
            start = shared_end
        if start < end:
            yield from hasher.iter_hashes(token_ids, seq.extra, parent, start, end - start)

    def _drop_out_of_window(self, seq: _SeqBlocks, w: int) -> None:
        """Release the blocks whose every position is out of the w-token window of the next token."""
        table = seq.table
        n = min(len(table), max(0, seq.computed - w + 1) // self.block_size)
        dropped = [b for b in table[:n] if b != DROPPED]
        if dropped:
            for j in range(n):
                table[j] = DROPPED
            self.window_drops += len(dropped)
            self.pool.release(reversed(dropped), False)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block (ref +1) and its computed count. Both lose their write
        grant: each must call allocate_slots (which copies on write) before writing again."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        p = self._seqs[parent_id]
        c = _SeqBlocks(p.extra, p.shared_extra, p.shared_blocks)
        take = self.pool.take
        for b in p.table:
            if b != DROPPED:
                take(b)
        c.table = list(p.table)
        c.hashes = list(p.hashes)
        c.computed = c.granted = p.granted = p.computed
        self._seqs[child_id] = c

    def free(self, seq_id: str, *, keep_warm: bool = False) -> None:
        """Drop the seq's refs (unknown ids are ignored, so aborts may race finishes).

        Blocks reaching ref 0 are released in reverse table order: hashed ones join the LRU tail
        (a chain's tail is evicted before its head), unhashed ones the head of the free queue.
        keep_warm puts hashed blocks in the protected tier, evicted only when the normal tier is
        empty (a live chat's next turn still hits under pressure). That tier holds at most
        max_warm_fraction of the blocks; past it, its oldest blocks are demoted to the LRU tail."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.release(reversed([b for b in seq.table if b != DROPPED]), keep_warm)

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of all ref-0 blocks. True if the cache is now empty; False if live
        sequences still hold hashed blocks (those keep their hashes)."""
        return self.pool.reset_hashes()

    # ── observability ─────────────────────────────────────────────────────────────────────────
    def stats(self) -> KVCacheStats:
        pool = self.pool
        used = pool.num_used
        alloc = filled = 0
        for s in self._seqs.values():
            alloc += sum(1 for b in s.table if b != DROPPED) if self.sliding_window else len(s.table)
            filled += s.computed
        return KVCacheStats(
            num_blocks=self.num_blocks, free_blocks=pool.num_clean, used_blocks=used,
            cached_blocks=pool.num_cached, usage=used / self.num_blocks,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            evictions=pool.evictions, cow_copies=self.cow_copies,
            allocated_slots=alloc * self.block_size, filled_slots=filled)

    def check_integrity(self) -> None:
        """Raise AssertionError (with a message) if any invariant is broken. O(blocks + table sizes).

        Pool: free + cached + used == total, refs >= 0, no block both free and referenced, every
        hashed block findable. Tables: each block's ref count equals the number of tables holding
        it; no table holds a block twice; computed <= granted <= table capacity; every block
        covering a seq's write grant [computed, granted) has ref 1 (no two live seqs can write the
        same block); the seq's hash chain matches the hashes its blocks are registered under."""
        pool = self.pool
        pool.check_integrity()
        bs = self.block_size
        counts = [0] * self.num_blocks
        for sid, s in self._seqs.items():
            t = s.table
            if self.sliding_window is None:
                live = t
                assert DROPPED not in t, f"seq {sid!r} has dropped blocks without a window"
            else:
                live = [b for b in t if b != DROPPED]
                edge = max(0, s.computed - self.sliding_window + 1) // bs
                assert DROPPED not in t[edge:], f"seq {sid!r} dropped a block still in its window"
            assert len(set(live)) == len(live), f"seq {sid!r} holds a block twice: {t}"
            for b in live:
                counts[b] += 1
            assert 0 <= s.computed <= s.granted <= len(t) * bs, \
                f"seq {sid!r}: computed {s.computed}, granted {s.granted}, capacity {len(t) * bs}"
            write_blocks = range(s.computed // bs, -(-s.granted // bs)) if s.granted > s.computed else ()
            for j in write_blocks:
                assert pool.ref_counts[t[j]] == 1, \
                    f"seq {sid!r} may write block {t[j]} (index {j}) but its ref is {pool.ref_counts[t[j]]}"
            if self.enable_prefix_caching:
                assert len(s.hashes) == s.computed // bs, \
                    f"seq {sid!r}: {len(s.hashes)} hashes for {s.computed // bs} full blocks"
                for j, h in enumerate(s.hashes):
                    if t[j] == DROPPED:
                        continue
                    bh = pool.block_hash[t[j]]
                    assert bh is None or bh == h, f"seq {sid!r}: block {t[j]} registered under another hash"
        for b in range(self.num_blocks):
            assert counts[b] == pool.ref_counts[b], \
                f"block {b}: ref count {pool.ref_counts[b]} but held by {counts[b]} tables"
