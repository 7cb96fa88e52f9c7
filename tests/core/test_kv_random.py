"""Randomized KVCacheManager test: 100,000 operations over a 2-token vocabulary (heavy sharing).

A shadow "physical memory" plays the runner: every slot records which (salt, prefix) its K/V was
computed for, CopyOps copy whole blocks, and every live sequence must read back exactly its own
prefix. check_integrity() runs after every operation.
"""
import random

from chatserve.core.kv_cache_manager import KVCacheManager

BS = 4
NUM_BLOCKS = 40
MAX_SEQS = 8
MAX_LEN = 40
SALTS = [None, None, "tenant-x"]


class Sim:
    def __init__(self, seed: int, window: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.window = window
        self.m = KVCacheManager(NUM_BLOCKS, BS, hash_seed=seed, watermark=0.05, sliding_window=window)
        self.mem: list[list[object]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.seqs: dict[str, tuple[list[int], list[int], str | None]] = {}  # id → tokens, prefix ids, salt
        self.expected: dict[bytes, tuple] = {}      # hash → content of the block it names
        self.next_id = 0
        self.prefixes = [tuple(self.rng.randint(0, 1) for _ in range(n)) for n in (5, 8, 12, 17)]
        self.ops = {"add": 0, "prefill": 0, "decode": 0, "fork": 0, "free": 0, "reset": 0, "oom": 0}

    # ── helpers ───────────────────────────────────────────────────────────────────────────────
    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    @staticmethod
    def extend_pids(toks: list[int], pids: list[int]) -> None:
        while len(pids) < len(toks):
            prev = pids[-1] if pids else 0
            pids.append(hash((prev, toks[len(pids)])))

    def verify_seq(self, sid: str) -> None:
        toks, pids, salt = self.seqs[sid]
        table = self.m.get_block_table(sid)
        c = self.m.num_computed_tokens(sid)
        first = 0 if self.window is None else max(0, c - self.window + 1)    # what attention still reads
        for p in range(first, c):
            got = self.mem[table[p // BS]][p % BS]
            assert got == (salt, p, pids[p]), f"{sid} reads wrong K/V at position {p}: {got}"

    def verify_cache(self) -> None:
        for h, b in self.m.pool.hash_to_block.items():
            assert tuple(self.mem[b]) == self.expected[h], f"cached block {b} was overwritten"

    # ── operations ────────────────────────────────────────────────────────────────────────────
    def add(self) -> None:
        rng = self.rng
        sid = self.new_id()
        if rng.random() < 0.6:                      # a shared "system prompt" or an earlier chat
            toks = list(rng.choice(self.prefixes)) + [rng.randint(0, 1) for _ in range(rng.randint(1, 6))]
        else:
            toks = [rng.randint(0, 1) for _ in range(rng.randint(1, 24))]
        salt = rng.choice(SALTS)
        hit = self.m.add_seq(sid, toks, cache_salt=salt)
        assert hit % BS == 0 and 0 <= hit < len(toks)
        pids: list[int] = []
        self.extend_pids(toks, pids)
        self.seqs[sid] = (toks, pids, salt)
        self.verify_seq(sid)
        self.ops["add"] += 1

    def step(self, sid: str) -> None:
        rng, m = self.rng, self.m
        toks, pids, salt = self.seqs[sid]
        c = m.num_computed_tokens(sid)
        if c == len(toks):                          # all known tokens computed: "sample" one
            if len(toks) >= MAX_LEN:
                self.free(sid)
                return
            toks.append(rng.randint(0, 1))
            self.extend_pids(toks, pids)
            k, kind = 1, "decode"
        else:
            k, kind = rng.randint(1, len(toks) - c), "prefill"
        ops = m.allocate_slots(sid, c + k, reserve_watermark=(c == 0 and rng.random() < 0.5))
        if ops is None:                             # out of blocks: preempt (free) it
            self.ops["oom"] += 1
            self.free(sid)
            return
        table = m.get_block_table(sid)
        for op in ops:
            assert op.src not in table and op.dst in table
            self.mem[op.dst] = list(self.mem[op.src])
        for p in range(c, c + k):                   # the "runner" writes K/V of new positions
            self.mem[table[p // BS]][p % BS] = (salt, p, pids[p])
        before = set(m.pool.hash_to_block)
        m.commit(sid, toks, c + k)
        for h in set(m.pool.hash_to_block) - before:
            content = tuple(self.mem[m.pool.hash_to_block[h]])
            assert self.expected.setdefault(h, content) == content, "one hash names two contents"
        self.verify_seq(sid)
        self.ops[kind] += 1

    def fork(self, sid: str) -> None:
        child = self.new_id()
        self.m.fork(sid, child)
        toks, pids, salt = self.seqs[sid]
        self.seqs[child] = (list(toks), list(pids), salt)
        self.verify_seq(child)
        self.ops["fork"] += 1

    def free(self, sid: str) -> None:
        toks = self.seqs[sid][0]
        if len(toks) > 4 and self.rng.random() < 0.2:   # its history comes back as a next turn
            self.prefixes[self.rng.randrange(len(self.prefixes))] = tuple(toks[:24])
        self.m.free(sid, keep_warm=self.rng.random() < 0.3)
        del self.seqs[sid]
        self.ops["free"] += 1

    def one_op(self) -> None:
        rng = self.rng
        r = rng.random()
        if not self.seqs or (r < 0.12 and len(self.seqs) < MAX_SEQS):
            self.add()
            return
        sid = rng.choice(list(self.seqs))
        if r < 0.22 and len(self.seqs) < MAX_SEQS:
            self.fork(sid)
        elif r < 0.28:
            self.free(sid)
        elif r < 0.2805:
            self.m.reset_prefix_cache()
            self.ops["reset"] += 1
        else:
            self.step(sid)


def run_then_free_all(sim: Sim, n_ops: int) -> None:
    """n_ops random operations (integrity after each, every read checked every 500), then free all."""
    m = sim.m
    for i in range(n_ops):
        sim.one_op()
        m.check_integrity()
        if i % 500 == 0:
            for sid in sim.seqs:
                sim.verify_seq(sid)
            sim.verify_cache()
    for sid in list(sim.seqs):
        sim.free(sid)
        m.check_integrity()
    sim.verify_cache()
    assert all(r == 0 for r in m.pool.ref_counts)
    assert m.num_free_blocks == NUM_BLOCKS


def test_100k_random_operations_keep_every_invariant():
    sim = Sim(seed=20261129)
    run_then_free_all(sim, 100_000)
    s = sim.m.stats()
    assert s.used_blocks == 0 and s.free_blocks + s.cached_blocks == NUM_BLOCKS
    # the run really exercised every path
    assert s.evictions > 1000 and s.cow_copies > 1000 and s.prefix_hits > 10_000, s
    assert all(v > 0 for v in sim.ops.values()), sim.ops


def test_random_operations_with_a_sliding_window_keep_every_invariant():
    """The same mix on a model whose every layer slides (window 6, 4-token blocks): blocks that left
    the window are released, what attention still reads is intact, nothing leaks."""
    sim = Sim(seed=20261201, window=6)
    run_then_free_all(sim, 20_000)
    m = sim.m
    assert m.window_drops > 1000 and m.stats().prefix_hits > 1000, (m.window_drops, m.stats())
