"""`chatserve bench sessions`: does session-aware caching (keep_warm) make turn N+1 of a live chat hit
the prefix cache while other traffic fills the KV cache? Real Scheduler + KVCacheManager, scripted runner.

Time is counted in scheduler steps, not seconds; no model and no torch. It measures cache hits and the
cost to the background traffic, not latency of real hardware.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import zlib
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

from chatserve.bench.progress import progress_bar
from chatserve.config import SchedulerConfig
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import Request, SamplingParams
from chatserve.core.scheduler import Scheduler

VOCAB = 49152
EOT = 2                     # stands in for the chat template's end-of-turn marker


@dataclass(frozen=True)
class Workload:
    """S chat sessions of T turns each, beside closed-loop background traffic."""

    sessions: int = 8
    turns: int = 6
    system_tokens: int = 64          # per-session system prompt
    user_tokens: int = 32            # each new user message (incl. its template tokens)
    reply_tokens: int = 32           # R: each assistant reply
    think_steps: tuple[int, int] = (60, 180)   # idle steps between a reply and the next message
    bg_concurrency: int = 8          # background requests in flight at all times
    bg_prefixes: int = 16            # pool of reusable background prefixes (documents, app prompts)
    bg_prefix_tokens: int = 192      # length of each reusable prefix
    bg_unique_tokens: int = 96       # random tail of each background prompt
    bg_output_tokens: int = 16
    block_size: int = 16
    budget: int = 512                # max_num_batched_tokens
    max_num_seqs: int = 32
    seed: int = 0
    max_steps: int = 20_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _runner(out: SchedulerOutput) -> RunnerOutput:
    """Scripted model: a deterministic token per (request, position); the content is irrelevant to
    the cache, only that the next turn's prompt repeats exactly what was generated."""
    return RunnerOutput(step_id=out.step_id, sampled={
        s.request_id: 3 + zlib.crc32(f"{s.request_id}:{s.seq_len}".encode()) % (VOCAB - 3)
        for s in out.seqs if s.sample})


def simulate(w: Workload, num_blocks: int, keep_warm: bool, *,
             max_warm_fraction: float | None = None) -> dict:
    """One run. Returns the turn-N+1 hit figures for the sessions and the background's own figures.
    max_warm_fraction None = the manager's default bound on protected blocks; 1.0 = unbounded."""
    rng = random.Random(w.seed)           # same prompts, think times and arrivals for both arms
    kw = {} if max_warm_fraction is None else {"max_warm_fraction": max_warm_fraction}
    kv = KVCacheManager(num_blocks, w.block_size, watermark=0.01, hash_seed=0, **kw)
    cfg = SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.budget,
                          max_waiting_requests=1 << 20, max_waiting_tokens=1 << 30)
    sched = Scheduler(cfg, kv, max_model_len=1 << 16)
    bs = w.block_size

    # Session state: the conversation so far (ids the template would produce), and when it speaks.
    history = [_tokens(rng, w.system_tokens) for _ in range(w.sessions)]
    turn = [0] * w.sessions
    next_at = [rng.randrange(0, w.think_steps[0]) for _ in range(w.sessions)]   # staggered starts
    live: dict[str, tuple[int, Request, int, int]] = {}   # rid → (session, request, arrival, cacheable)
    prefixes = [_tokens(rng, w.bg_prefix_tokens) for _ in range(w.bg_prefixes)]
    bg_live: dict[str, Request] = {}
    bg_n = 0

    turn_rows: list[dict] = []     # one per session turn >= 2
    first_tok: dict[str, int] = {}
    bg_prompt = bg_cached = bg_done = bg_out = 0
    step = computed = all_prompt = all_cached = 0
    done_sessions = 0

    def add_bg() -> None:
        nonlocal bg_n
        p = rng.randrange(w.bg_prefixes)
        prompt = prefixes[p] + _tokens(rng, w.bg_unique_tokens)
        r = Request(f"bg{bg_n}", prompt, SamplingParams(max_tokens=w.bg_output_tokens, ignore_eos=True),
                    cache_salt=f"app{p % 4}")
        bg_n += 1
        bg_live[r.request_id] = r
        sched.add_request(r)

    for _ in range(w.bg_concurrency):
        add_bg()
    while done_sessions < w.sessions and step < w.max_steps:
        for s in range(w.sessions):
            if next_at[s] == step and turn[s] < w.turns:
                prev = history[s]
                prompt = prev + _tokens(rng, w.user_tokens)
                # the best a cache can do: the full blocks computed in the previous turn (its last
                # sampled token and EOT were never run through the model)
                cacheable = 0 if turn[s] == 0 else min((len(prev) - 2) // bs, (len(prompt) - 1) // bs) * bs
                rid = f"s{s}.t{turn[s]}"
                r = Request(rid, prompt, SamplingParams(max_tokens=w.reply_tokens, ignore_eos=True),
                            cache_salt=f"owner{s}", keep_warm=keep_warm)
                live[rid] = (s, r, step, cacheable)
                sched.add_request(r)
        out = sched.schedule()
        computed += out.num_batched_tokens
        for ev in sched.update(out, _runner(out)):
            rid = ev.request_id
            if rid in live and rid not in first_tok and ev.new_token_ids:
                first_tok[rid] = step
            if not ev.finished:
                continue
            if rid in live:
                s, r, arrived, cacheable = live.pop(rid)
                all_prompt += r.num_prompt_tokens
                all_cached += r.num_cached_tokens
                if turn[s] > 0:
                    turn_rows.append({"turn": turn[s] + 1, "prompt": r.num_prompt_tokens,
                                      "cached": r.num_cached_tokens, "cacheable": cacheable,
                                      "ttft_steps": first_tok[rid] - arrived + 1})
                history[s] = r.prompt_token_ids + r.output_token_ids + [EOT]
                turn[s] += 1
                if turn[s] >= w.turns:
                    done_sessions += 1
                else:
                    next_at[s] = step + 1 + rng.randint(*w.think_steps)
            elif rid in bg_live:
                r = bg_live.pop(rid)
                bg_prompt += r.num_prompt_tokens
                bg_cached += r.num_cached_tokens
                all_prompt += r.num_prompt_tokens
                all_cached += r.num_cached_tokens
                bg_out += len(r.output_token_ids)
                bg_done += 1
                add_bg()
        if step % 500 == 0:
            kv.check_integrity()
        step += 1
    kv.check_integrity()
    warm_cap = kv.pool.max_warm

    prompt_tot = sum(t["prompt"] for t in turn_rows)
    cached_tot = sum(t["cached"] for t in turn_rows)
    cacheable_tot = sum(t["cacheable"] for t in turn_rows)
    fracs = [t["cached"] / t["prompt"] for t in turn_rows]
    st = kv.stats()
    return {
        "num_blocks": num_blocks, "keep_warm": keep_warm, "max_warm_blocks": warm_cap,
        "completed": done_sessions == w.sessions, "steps": step,
        "turns_measured": len(turn_rows),
        "session_hit_frac": cached_tot / prompt_tot if prompt_tot else 0.0,     # Σcached / Σprompt
        "session_hit_frac_mean": statistics.fmean(fracs) if fracs else 0.0,     # mean over turns
        "session_full_hits": sum(t["cached"] >= t["cacheable"] for t in turn_rows) / max(1, len(turn_rows)),
        "session_cacheable_frac": cacheable_tot / prompt_tot if prompt_tot else 0.0,   # the ceiling
        "session_ttft_steps_mean": statistics.fmean(t["ttft_steps"] for t in turn_rows) if turn_rows else 0.0,
        "bg_hit_frac": bg_cached / bg_prompt if bg_prompt else 0.0,
        "bg_requests": bg_done,
        "bg_requests_per_kstep": 1000.0 * bg_done / step if step else 0.0,
        "bg_output_tokens_per_step": bg_out / step if step else 0.0,
        "all_hit_frac": all_cached / all_prompt if all_prompt else 0.0,   # every prompt, both kinds
        "tokens_computed": computed,          # prefill + decode tokens run by the "model", all traffic
        "preemptions": sched.num_preemptions,
        "warm_demotions": kv.pool.warm_demotions,
        "evictions": st.evictions,
        "warm_blocks_end": kv.pool.num_warm,
    }


def default_cache_sizes(w: Workload) -> list[int]:
    """Three pressures, sized from the workload: the blocks background traffic holds at once, plus
    room for ~1/4, ~1/2 and ~all of the sessions' final histories."""
    bs = w.block_size
    bg_used = w.bg_concurrency * -(-(w.bg_prefix_tokens + w.bg_unique_tokens + w.bg_output_tokens) // bs)
    final = w.system_tokens + w.turns * (w.user_tokens + w.reply_tokens + 1)
    sess = w.sessions * -(-final // bs)
    return [bg_used + sess // 4, bg_used + sess // 2, bg_used + sess]


def run(workload: Workload | None = None, cache_sizes: list[int] | None = None, *,
        max_warm_fraction: float | None = None, starvation: bool = True, progress: bool = False) -> dict:
    """keep_warm off vs on at each cache size; plus a many-idle-sessions setting that checks whether
    the protected tier can crowd out the background traffic's cache, with the warm tier unbounded
    (max_warm_fraction 1.0) and with the manager's bound."""
    w = workload or Workload()
    sizes = cache_sizes or default_cache_sizes(w)
    bar = progress_bar(2 * len(sizes) + (3 if starvation else 0), progress, desc="bench sessions", unit="run")

    def one(wl: Workload, num_blocks: int, keep_warm: bool, warm_fraction: float | None) -> dict:
        row = simulate(wl, num_blocks, keep_warm, max_warm_fraction=warm_fraction)
        if bar is not None:
            bar.update(1)
        return row

    rows = [one(w, n, kw, max_warm_fraction) for n in sizes for kw in (False, True)]
    res: dict = {"rows": rows}
    if starvation:
        # 8x the sessions, long idle gaps: their warm histories together far exceed the cache.
        sw = replace(w, sessions=8 * w.sessions, turns=3, think_steps=(400, 800))
        n = 2 * sizes[-1] - sizes[0] - (sizes[-1] - sizes[0]) // 3   # a large cache: bg + ~2x sessions
        res["starvation"] = [one(sw, n, False, max_warm_fraction), one(sw, n, True, 1.0),
                             one(sw, n, True, max_warm_fraction)]
        res["starvation_workload"] = {"sessions": sw.sessions, "turns": sw.turns,
                                      "think_steps": list(sw.think_steps), "num_blocks": n}
    if bar is not None:
        bar.close()
    cfg = asdict(w)
    cfg["think_steps"] = list(w.think_steps)
    res["config"] = {**cfg, "cache_sizes": sizes, "max_warm_fraction": max_warm_fraction,
                     "manager_default_max_warm_fraction": KVCacheManager(1).max_warm_fraction,
                     "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                     "python": sys.version.split()[0]}
    return res


def _table(res: dict) -> str:
    head = (f"{'blocks':>6} {'keep_warm':>9} {'turn N+1 hit':>12} {'mean/turn':>9} {'ceiling':>7} "
            f"{'TTFT steps':>10} {'bg hit':>7} {'bg req/kstep':>12} {'all hit':>7} {'preempt':>7} "
            f"{'steps':>6}")
    lines = [head]

    def line(r: dict) -> str:
        kw = "off" if not r["keep_warm"] else (
            "on" if r["max_warm_blocks"] is None or r["max_warm_blocks"] < r["num_blocks"] else "on,nocap")
        return (f"{r['num_blocks']:>6} {kw:>9} "
                f"{r['session_hit_frac']:>12.1%} {r['session_hit_frac_mean']:>9.1%} "
                f"{r['session_cacheable_frac']:>7.1%} {r['session_ttft_steps_mean']:>10.1f} "
                f"{r['bg_hit_frac']:>7.1%} {r['bg_requests_per_kstep']:>12.1f} {r['all_hit_frac']:>7.1%} "
                f"{r['preemptions']:>7} {r['steps']:>6}")

    lines += [line(r) for r in res["rows"]]
    if "starvation" in res:
        sw = res["starvation_workload"]
        lines.append(f"many idle sessions ({sw['sessions']} sessions x {sw['turns']} turns, think "
                     f"{sw['think_steps'][0]}-{sw['think_steps'][1]} steps):")
        lines += [line(r) for r in res["starvation"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chatserve bench sessions", description=__doc__)
    d = Workload()
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--sessions", type=int, default=d.sessions)
    ap.add_argument("--turns", type=int, default=d.turns)
    ap.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    ap.add_argument("--user-tokens", type=int, default=d.user_tokens)
    ap.add_argument("--think-steps", default=f"{d.think_steps[0]},{d.think_steps[1]}",
                    help="MIN,MAX idle steps between turns")
    ap.add_argument("--bg-concurrency", type=int, default=d.bg_concurrency)
    ap.add_argument("--cache-sizes", default="", help="comma-separated block counts (default: 3 derived)")
    ap.add_argument("--max-warm-fraction", type=float, default=None,
                    help="share of blocks keep_warm may protect (default: the manager's; 1.0 = unbounded)")
    ap.add_argument("--no-starvation", action="store_true", help="skip the many-idle-sessions check")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    lo, hi = (int(x) for x in args.think_steps.split(","))
    w = replace(d, sessions=args.sessions, turns=args.turns, reply_tokens=args.reply_tokens,
                user_tokens=args.user_tokens, think_steps=(lo, hi), bg_concurrency=args.bg_concurrency,
                seed=args.seed)
    sizes = [int(x) for x in args.cache_sizes.split(",") if x] or None
    res = run(w, sizes, max_warm_fraction=args.max_warm_fraction, starvation=not args.no_starvation,
              progress=not args.no_progress)
    print(json.dumps(res, sort_keys=True) if args.json else _table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
