"""`chatserve bench memory`: the KV cache manager's memory efficiency and speed, on synthetic workloads.

Drives KVCacheManager directly (pure Python, no model, no torch): internal waste, paged vs contiguous
concurrency, parallel-sampling and fork-tree sharing, and µs per append / free / prefix match.
"""
from __future__ import annotations

import random
import statistics
import sys
import time

from chatserve.bench.report import bench_parser, goal_table, goals_met, print_result, run_stamp
from chatserve.core.kv_cache_manager import KVCacheManager

GOALS: dict[str, tuple[str, float]] = {       # key → (comparison, bound)
    "waste_pct": ("<", 4.0),
    "paged_vs_contiguous_concurrency": (">=", 3.0),
    "parallel_sampling_saving": (">=", 0.75),
    "append_us": ("<", 10.0),
    "match_us": ("<", 1000.0),
}


def _workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49152) for _ in range(n)]


# ── internal waste ────────────────────────────────────────────────────────────────────────────
def internal_waste(work: list[tuple[int, int]], block_size: int, seed: int = 0) -> float:
    """Allocated-but-unfilled slots / allocated slots, summed over every step of every request's
    life (after its prefill and after each decoded token), in percent."""
    rng = random.Random(seed)
    longest = max(p + o for p, o in work)
    m = KVCacheManager(-(-longest // block_size) + 1, block_size, watermark=0.0, hash_seed=seed)
    alloc = unfilled = 0
    for i, (p, o) in enumerate(work):
        sid = f"r{i}"
        toks = _tokens(rng, p)
        m.add_seq(sid, toks)
        m.allocate_slots(sid, p)
        m.commit(sid, toks, p)
        a = m.num_allocated_slots(sid)
        alloc += a
        unfilled += a - p
        for n in range(p + 1, p + o + 1):
            toks.append(n & 0xFFFF)
            m.allocate_slots(sid, n)
            m.commit(sid, toks, n)
            a = m.num_allocated_slots(sid)
            alloc += a
            unfilled += a - n
        m.free(sid)
    return 100.0 * unfilled / alloc


# ── concurrency ───────────────────────────────────────────────────────────────────────────────
def paged_concurrency(work: list[tuple[int, int]], budget_slots: int, block_size: int,
                      max_len: int, seed: int = 0, sliding_window: int | None = None) -> tuple[float, int]:
    """Continuous batching in `budget_slots` slots: FCFS admission (prompt must fit above the
    watermark), one decode token per running request per step, preempt-newest on a full cache.
    Returns (mean running requests over the steps while requests were still waiting, preemptions).
    Lengths are capped at max_len (the contiguous allocator's reservation) so both serve the
    same requests. sliding_window: a model whose every layer sees at most that many positions (the
    manager releases blocks that slid out)."""
    rng = random.Random(seed)
    m = KVCacheManager(budget_slots // block_size, block_size, watermark=0.01, hash_seed=seed,
                       sliding_window=sliding_window)
    reqs = [(min(p, max_len - 1), min(p + o, max_len) - min(p, max_len - 1)) for p, o in work]
    toks = {i: _tokens(rng, p) for i, (p, _) in enumerate(reqs)}
    waiting = list(range(len(reqs)))
    running: list[int] = []
    left = {i: o for i, (_, o) in enumerate(reqs)}
    steps = running_sum = preemptions = 0
    while waiting:
        while waiting:                                   # admit in order while prompts fit
            i = waiting[0]
            sid, t = f"r{i}", toks[i]
            m.add_seq(sid, t)
            if m.allocate_slots(sid, len(t), reserve_watermark=True) is None:
                m.free(sid)
                break
            m.commit(sid, t, len(t))
            running.append(waiting.pop(0))
        if not waiting:
            break                                        # the tail (draining) is not steady state
        steps += 1
        running_sum += len(running)
        k = 0
        while k < len(running):                          # one decode step, oldest first
            i = running[k]
            sid, t = f"r{i}", toks[i]
            ops = m.allocate_slots(sid, len(t) + 1)
            while ops is None:                           # preempt the newest; it recomputes later
                victim = running.pop()
                m.free(f"r{victim}")
                waiting.insert(0, victim)
                preemptions += 1
                if victim == i:
                    break
                ops = m.allocate_slots(sid, len(t) + 1)
            if ops is None:
                break
            t.append(7)
            m.commit(sid, t, len(t))
            left[i] -= 1
            if left[i] == 0:
                running.pop(k)
                m.free(sid)
            else:
                k += 1
    return (running_sum / steps if steps else float(len(reqs))), preemptions


# ── sharing ───────────────────────────────────────────────────────────────────────────────────
def _decode_all(m: KVCacheManager, seqs: dict[str, list[int]], n: int, rng: random.Random) -> None:
    for _ in range(n):
        for sid, t in seqs.items():
            t.append(rng.randrange(49152))
            assert m.allocate_slots(sid, len(t)) is not None
            m.commit(sid, t, len(t))


def _prefill_and_fork(m: KVCacheManager, prompt: list[int], prefix: str, n: int) -> dict[str, list[int]]:
    """Sequence `prefix`0 computes the prompt and n-1 forks share it; each sequence id → its tokens."""
    first = f"{prefix}0"
    m.add_seq(first, prompt)
    m.allocate_slots(first, len(prompt))
    m.commit(first, prompt, len(prompt))
    seqs = {first: list(prompt)}
    for k in range(1, n):
        m.fork(first, f"{prefix}{k}")
        seqs[f"{prefix}{k}"] = list(prompt)
    return seqs


def parallel_sampling(n: int, prompt_len: int, out_len: int, block_size: int,
                      seed: int = 0) -> dict[str, float]:
    """n samples of one prompt: slots used with fork sharing vs n independent copies; also the
    prefix-cache path (n separate requests with the same prompt, no fork)."""
    rng = random.Random(seed)
    prompt = _tokens(rng, prompt_len)
    nb = n * (-(-(prompt_len + out_len) // block_size) + 1)

    def used(m: KVCacheManager) -> int:
        return m.stats().used_blocks * block_size

    # fork: the leader computes the prompt once, then n-1 children share it
    m = KVCacheManager(nb, block_size, watermark=0.0, hash_seed=seed)
    seqs = _prefill_and_fork(m, prompt, "s", n)
    _decode_all(m, seqs, out_len, rng)
    shared = used(m)
    cow = m.stats().cow_copies
    # prefix cache: n requests, each looks the prompt up (the last block is recomputed)
    def separate_requests(m: KVCacheManager) -> int:
        """n independent requests of the prompt on m; slots used once all have decoded."""
        seqs = {}
        for k in range(n):
            sid = f"s{k}"
            m.add_seq(sid, prompt)
            m.allocate_slots(sid, prompt_len)
            m.commit(sid, prompt, prompt_len)
            seqs[sid] = list(prompt)
        _decode_all(m, seqs, out_len, rng)
        return used(m)

    cached = separate_requests(KVCacheManager(nb, block_size, watermark=0.0, hash_seed=seed))
    # no sharing at all
    alone = separate_requests(KVCacheManager(nb, block_size, watermark=0.0, enable_prefix_caching=False))
    return {"parallel_sampling_saving": 1 - shared / alone,
            "parallel_sampling_saving_prefix_cache": 1 - cached / alone,
            "parallel_sampling_slots_shared": shared, "parallel_sampling_slots_unshared": alone,
            "parallel_sampling_cow_copies": cow}


def fork_tree(width: int, rounds: int, prompt_len: int, tokens_per_round: int, block_size: int,
              seed: int = 0) -> dict[str, float]:
    """Beam-search-like tree: `width` beams; each round every beam decodes tokens_per_round
    tokens, then `width` parents are drawn (with replacement) from the beams: a beam drawn k times
    is forked k-1 times, a beam never drawn is freed. Slots saved = Σ per-beam table slots −
    physical slots used, at the end (and at the peak)."""
    rng = random.Random(seed)
    cap = width * (prompt_len + rounds * tokens_per_round) // block_size + 4 * width * rounds
    m = KVCacheManager(cap, block_size, watermark=0.0, hash_seed=seed)
    prompt = _tokens(rng, prompt_len)
    beams = _prefill_and_fork(m, prompt, "b", width)
    next_id, forks, best_saved = width, width - 1, 0
    for _ in range(rounds):
        _decode_all(m, beams, tokens_per_round, rng)
        logical = sum(m.num_allocated_slots(s) for s in beams)
        best_saved = max(best_saved, logical - m.stats().used_blocks * block_size)
        picks = [rng.choice(sorted(beams)) for _ in range(width)]
        new: dict[str, list[int]] = {}
        for sid in sorted(beams):
            k = picks.count(sid)
            if k == 0:
                m.free(sid)
                continue
            new[sid] = beams[sid]
            for _ in range(k - 1):
                cid = f"b{next_id}"
                next_id += 1
                m.fork(sid, cid)
                forks += 1
                new[cid] = list(beams[sid])
        beams = new
    logical = sum(m.num_allocated_slots(s) for s in beams)
    physical = m.stats().used_blocks * block_size
    return {"fork_tree_slots_saved": logical - physical, "fork_tree_saving": 1 - physical / logical,
            "fork_tree_peak_slots_saved": max(best_saved, logical - physical),
            "fork_tree_forks": forks, "fork_tree_cow_copies": m.stats().cow_copies}


# ── speed ─────────────────────────────────────────────────────────────────────────────────────
def speed(num_seqs: int, seq_len: int, block_size: int, rounds: int = 32,
          seed: int = 0) -> dict[str, float]:
    """µs per append (allocate_slots + commit of one token), per free of a whole seq, and per
    prefix match (add_seq of a cached seq_len-token prompt), with num_seqs running seqs.
    Medians (of per-round means for append), so a busy shared machine skews them less."""
    rng = random.Random(seed)
    per_seq = -(-(seq_len + block_size + rounds) // block_size)
    m = KVCacheManager(num_seqs * per_seq + per_seq + 1, block_size, watermark=0.0, hash_seed=seed)
    seqs: dict[str, list[int]] = {}
    for i in range(num_seqs):
        sid = f"s{i}"
        t = _tokens(rng, seq_len + i % block_size)   # staggered: block fills spread over rounds
        m.add_seq(sid, t)
        m.allocate_slots(sid, len(t))
        m.commit(sid, t, len(t))
        seqs[sid] = t
    items = list(seqs.items())
    alloc, commit = m.allocate_slots, m.commit
    clock = time.perf_counter
    round_s: list[float] = []
    for r in range(rounds):                         # each round: one token for every seq
        t0 = clock()
        for sid, t in items:
            t.append(r)
            n = len(t)
            alloc(sid, n)
            commit(sid, t, n)
        round_s.append(clock() - t0)
    append_us = statistics.median(round_s) * 1e6 / num_seqs

    match_s: list[float] = []
    hits = 0
    for i in range(min(num_seqs, 64)):
        prompt = seqs[f"s{i}"][:seq_len]
        t0 = clock()
        hits += m.add_seq("probe", prompt)
        match_s.append(clock() - t0)
        m.free("probe")
    expect = (seq_len - 1) // block_size * block_size
    assert hits == len(match_s) * expect, "speed bench: the prefix match missed"
    match_us = statistics.median(match_s) * 1e6

    free_s: list[float] = []
    for sid, _ in items:
        t0 = clock()
        m.free(sid)
        free_s.append(clock() - t0)
    free_us = statistics.median(free_s) * 1e6
    return {"append_us": append_us, "free_us": free_us, "match_us": match_us}


# ── entry points ──────────────────────────────────────────────────────────────────────────────
def run(num_requests: int = 1000, *, prompt_range: tuple[int, int] = (16, 2048),
        output_range: tuple[int, int] = (16, 1024), budget_slots: int = 65536,
        contiguous_slots: int = 2048, samples: int = 8, sample_prompt: int = 1024,
        sample_output: int = 128, tree_width: int = 4, tree_rounds: int = 8, tree_prompt: int = 512,
        tree_tokens_per_round: int = 24, speed_seqs: int = 256, speed_len: int = 2048,
        seed: int = 0) -> dict:
    """All figures as one flat dict (block size 16 unless the key says otherwise)."""
    work = _workload(num_requests, prompt_range, output_range, seed)
    res: dict = {}
    for bs in (16, 8, 32):
        res["waste_pct" if bs == 16 else f"waste_pct_bs{bs}"] = internal_waste(work, bs, seed)
    paged, preempt = paged_concurrency(work, budget_slots, 16, contiguous_slots, seed)
    contiguous = budget_slots // contiguous_slots
    res["paged_vs_contiguous_concurrency"] = paged / contiguous
    res["paged_concurrency"] = paged
    res["contiguous_concurrency"] = contiguous
    res["paged_preemptions"] = preempt
    res["requests_longer_than_contiguous"] = sum(p + o > contiguous_slots for p, o in work)
    # The same comparison without truncation: a contiguous allocator that can serve every request
    # of this workload must reserve its longest possible length (prompt max + output max).
    worst = prompt_range[1] + output_range[1]
    paged_full, _ = paged_concurrency(work, budget_slots, 16, worst, seed)
    res["paged_vs_contiguous_worst_case_concurrency"] = paged_full / (budget_slots // worst)
    # a model whose every layer slides over 1024 positions: blocks behind the window are released
    windowed, _ = paged_concurrency(work, budget_slots, 16, worst, seed, sliding_window=1024)
    res["sliding_window_1024_concurrency"] = windowed
    res["sliding_window_1024_vs_full_concurrency"] = windowed / paged_full
    mean_len = sum(p + o / 2 for p, o in work) / len(work)
    res["mean_resident_tokens"] = mean_len
    res.update(parallel_sampling(samples, sample_prompt, sample_output, 16, seed))
    res.update(fork_tree(tree_width, tree_rounds, tree_prompt, tree_tokens_per_round, 16, seed))
    res.update(speed(speed_seqs, speed_len, 16, seed=seed))
    res["goals_met"] = goals_met(res, GOALS)
    res["config"] = {"num_requests": num_requests, "prompt_range": list(prompt_range),
                     "output_range": list(output_range), "budget_slots": budget_slots,
                     "contiguous_slots": contiguous_slots, "samples": samples,
                     "sample_prompt": sample_prompt, "sample_output": sample_output,
                     "tree_width": tree_width, "tree_rounds": tree_rounds, "tree_prompt": tree_prompt,
                     "tree_tokens_per_round": tree_tokens_per_round, "speed_seqs": speed_seqs,
                     "speed_len": speed_len, "seed": seed, **run_stamp()}
    return res


def _table(res: dict) -> str:
    rows = [
        ("waste_pct", "internal waste, block 16 (%)", "{:.2f}"),
        ("waste_pct_bs8", "internal waste, block 8 (%)", "{:.2f}"),
        ("waste_pct_bs32", "internal waste, block 32 (%)", "{:.2f}"),
        ("paged_concurrency", "paged: mean running requests", "{:.1f}"),
        ("contiguous_concurrency", "contiguous (2048/request): running", "{:d}"),
        ("paged_vs_contiguous_concurrency", "paged / contiguous concurrency", "{:.2f}"),
        ("paged_vs_contiguous_worst_case_concurrency", "  same, uncapped vs 3072/request", "{:.2f}"),
        ("sliding_window_1024_concurrency", "sliding window 1024: mean running", "{:.1f}"),
        ("sliding_window_1024_vs_full_concurrency", "  window 1024 / full attention", "{:.2f}"),
        ("parallel_sampling_saving", "parallel sampling saving (fork)", "{:.3f}"),
        ("parallel_sampling_saving_prefix_cache", "parallel sampling saving (prefix cache)", "{:.3f}"),
        ("fork_tree_slots_saved", "fork tree: slots saved", "{:d}"),
        ("fork_tree_saving", "fork tree: fraction saved", "{:.3f}"),
        ("append_us", "µs per append", "{:.2f}"),
        ("free_us", "µs per free (whole seq)", "{:.1f}"),
        ("match_us", "µs per 2k-token prefix match", "{:.1f}"),
    ]
    return goal_table(res, rows, GOALS, label_width=42)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("chatserve bench memory", __doc__)
    ap.add_argument("--requests", type=int, default=1000, help="requests in the waste/concurrency workload")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    res = run(args.requests, seed=args.seed)
    return print_result(res, args.json, _table)


if __name__ == "__main__":
    sys.exit(main())
