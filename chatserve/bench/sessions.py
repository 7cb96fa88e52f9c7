"""`chatserve bench sessions`: does session-aware caching (keep_warm) make turn N+1 of a live chat hit
the prefix cache while other traffic fills the KV cache? Real Scheduler + KVCacheManager, scripted runner.

Time is counted in scheduler steps, not seconds; no model and no torch. It measures cache hits and the
cost to the background traffic, not latency of real hardware.
"""
from __future__ import annotations

import random
from typing import Any
import statistics
import sys
import zlib
from dataclasses import asdict, dataclass, replace

from chatserve.bench.progress import progress_bar
from chatserve.bench.report import bench_parser, print_result, run_stamp
from chatserve.config import SchedulerConfig
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import Request, SamplingParams
from chatserve.core.scheduler import Scheduler
from chatserve.server.shared_prompts import common_prefix_len

VOCAB = 49152
EOT = 2                     # stands in for the chat template's end-of-turn marker


@dataclass(frozen=True)
class Workload:
    """S chat sessions of T turns each, beside closed-loop background traffic."""

    sessions: int = 8
    turns: int = 6
    system_tokens: int = 64          # per-session system prompt
    user_tokens: int = 32            # each new user message (incl. its template tokens)
    reply_tokens: int = 32           # R: each assistant reply (its answer)
    think_tokens: int = 0            # a reasoning model's thinking before the answer, sampled like it
    # the chat template drops earlier turns' thinking from the next prompt (Qwen3, DeepSeek-R1, QwQ)
    strip_thinking: bool = False
    # after a reply, prefill the next prompt's prefix (the history as the template re-renders it) with
    # keep_warm while the user reads: chatserve's sessions do this when the template strips thinking
    rewarm: bool = False
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
    return _Simulation(w, num_blocks, keep_warm, max_warm_fraction).run()


class _Simulation:
    """One run's state: the sessions' conversations, the background traffic, and the counters."""

    def __init__(self, w: Workload, num_blocks: int, keep_warm: bool, max_warm_fraction: float | None) -> None:
        self.w, self.num_blocks, self.keep_warm = w, num_blocks, keep_warm
        self.rng = rng = random.Random(w.seed)     # same prompts, think times and arrivals for both arms
        kw: dict[str, Any] = {} if max_warm_fraction is None else {"max_warm_fraction": max_warm_fraction}
        self.kv = KVCacheManager(num_blocks, w.block_size, watermark=0.01, hash_seed=0, **kw)
        cfg = SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.budget,
                              max_waiting_requests=1 << 20, max_waiting_tokens=1 << 30)
        self.sched = Scheduler(cfg, self.kv, max_model_len=1 << 16)

        # Session state: the conversation so far (ids the template would produce), and when it speaks.
        self.history = [_tokens(rng, w.system_tokens) for _ in range(w.sessions)]
        self.in_cache: list[list[int]] = [[] for _ in range(w.sessions)]   # ids whose K/V the model computed
        self.warm: dict[str, int] = {}        # rewarm request id → session
        self.sampled = [0] * w.sessions       # last turn's prompt + reply as sampled + EOT, in tokens
        self.turn = [0] * w.sessions
        self.next_at = [rng.randrange(0, w.think_steps[0]) for _ in range(w.sessions)]   # staggered starts
        self.live: dict[str, tuple[int, Request, int, int]] = {}   # rid → (session, request, arrival, cacheable)
        self.prefixes = [_tokens(rng, w.bg_prefix_tokens) for _ in range(w.bg_prefixes)]
        self.bg_live: dict[str, Request] = {}
        self.bg_n = 0

        self.turn_rows: list[dict] = []     # one per session turn >= 2
        self.first_tok: dict[str, int] = {}
        self.bg_prompt = self.bg_cached = self.bg_done = self.bg_out = 0
        self.step = self.computed = self.all_prompt = self.all_cached = 0
        self.done_sessions = 0

    def run(self) -> dict:
        w = self.w
        for _ in range(w.bg_concurrency):
            self.add_background()
        while self.done_sessions < w.sessions and self.step < w.max_steps:
            for s in range(w.sessions):
                if self.next_at[s] == self.step and self.turn[s] < w.turns:
                    self.add_turn(s)
            out = self.sched.schedule()
            self.computed += out.num_batched_tokens
            for ev in self.sched.update(out, _runner(out)):
                rid = ev.request_id
                if rid in self.live and rid not in self.first_tok and ev.new_token_ids:
                    self.first_tok[rid] = self.step
                if not ev.finished:
                    continue
                if rid in self.live:
                    self.finish_turn(rid)
                elif rid in self.warm:
                    self.warm.pop(rid)
                elif rid in self.bg_live:
                    self.finish_background(rid)
            if self.step % 500 == 0:
                self.kv.check_integrity()
            self.step += 1
        self.kv.check_integrity()
        return self.summary()

    def add_background(self) -> None:
        w, rng = self.w, self.rng
        p = rng.randrange(w.bg_prefixes)
        prompt = self.prefixes[p] + _tokens(rng, w.bg_unique_tokens)
        r = Request(f"bg{self.bg_n}", prompt, SamplingParams(max_tokens=w.bg_output_tokens, ignore_eos=True),
                    cache_salt=f"app{p % 4}")
        self.bg_n += 1
        self.bg_live[r.request_id] = r
        self.sched.add_request(r)

    def add_turn(self, s: int) -> None:
        """Session s sends its next user message."""
        w, bs = self.w, self.w.block_size
        prev = self.history[s]
        prompt = prev + _tokens(self.rng, w.user_tokens)
        # the best a cache can do: the full blocks of what the model computed before that the prompt
        # starts with (the previous turn's last sampled token and EOT were never run through it)
        common = common_prefix_len(self.in_cache[s], prompt)
        cacheable = 0 if self.turn[s] == 0 else min(common // bs, (len(prompt) - 1) // bs) * bs
        rid = f"s{s}.t{self.turn[s]}"
        r = Request(rid, prompt, SamplingParams(max_tokens=w.think_tokens + w.reply_tokens, ignore_eos=True),
                    cache_salt=f"owner{s}", keep_warm=self.keep_warm)
        self.live[rid] = (s, r, self.step, cacheable)
        self.sched.add_request(r)

    def finish_turn(self, rid: str) -> None:
        s, r, arrived, cacheable = self.live.pop(rid)
        self.all_prompt += r.num_prompt_tokens
        self.all_cached += r.num_cached_tokens
        if self.turn[s] > 0:
            prev = self.sampled[s]                # last turn's prompt + reply as sampled + EOT
            self.turn_rows.append({"turn": self.turn[s] + 1, "prompt": r.num_prompt_tokens,
                                   "cached": r.num_cached_tokens, "cacheable": cacheable,
                                   "reuse": min(r.num_cached_tokens, prev) / prev,
                                   "ttft_steps": self.first_tok[rid] - arrived + 1})
        out = r.output_token_ids
        self.in_cache[s] = r.prompt_token_ids + out[:-1]
        answer = out[self.w.think_tokens:] if self.w.strip_thinking else out
        self.history[s] = r.prompt_token_ids + answer + [EOT]      # what the next prompt starts with
        self.sampled[s] = len(r.prompt_token_ids) + len(out) + 1
        if self.w.strip_thinking and self.w.rewarm:
            self.add_rewarm(s, rid)
        self.turn[s] += 1
        if self.turn[s] >= self.w.turns:
            self.done_sessions += 1
        else:
            self.next_at[s] = self.step + 1 + self.rng.randint(*self.w.think_steps)

    def add_rewarm(self, s: int, rid: str) -> None:
        """Prefill the session's history as its next prompt will start (one token sampled, dropped)."""
        warm = Request(f"{rid}.warm", list(self.history[s]), SamplingParams(max_tokens=1, ignore_eos=True),
                       cache_salt=f"owner{s}", keep_warm=self.keep_warm)
        self.warm[warm.request_id] = s
        self.in_cache[s] = list(self.history[s])
        self.sched.add_request(warm)

    def finish_background(self, rid: str) -> None:
        r = self.bg_live.pop(rid)
        self.bg_prompt += r.num_prompt_tokens
        self.bg_cached += r.num_cached_tokens
        self.all_prompt += r.num_prompt_tokens
        self.all_cached += r.num_cached_tokens
        self.bg_out += len(r.output_token_ids)
        self.bg_done += 1
        self.add_background()

    def summary(self) -> dict:
        rows, step, kv = self.turn_rows, self.step, self.kv
        prompt_tot = sum(t["prompt"] for t in rows)
        cached_tot = sum(t["cached"] for t in rows)
        cacheable_tot = sum(t["cacheable"] for t in rows)
        fracs = [t["cached"] / t["prompt"] for t in rows]
        st = kv.stats()
        return {
            "num_blocks": self.num_blocks, "keep_warm": self.keep_warm, "max_warm_blocks": kv.pool.max_warm,
            "completed": self.done_sessions == self.w.sessions, "steps": step,
            "turns_measured": len(rows),
            "session_hit_frac": cached_tot / prompt_tot if prompt_tot else 0.0,     # Σcached / Σprompt
            "session_hit_frac_mean": statistics.fmean(fracs) if fracs else 0.0,     # mean over turns
            "session_full_hits": sum(t["cached"] >= t["cacheable"] for t in rows) / max(1, len(rows)),
            "session_cacheable_frac": cacheable_tot / prompt_tot if prompt_tot else 0.0,   # the ceiling
            # share of the previous turn's tokens as sampled (prompt + thinking + answer + EOT) served
            # from the cache at the next turn: docs/chat-templates.md's reuse
            "session_reuse_mean": statistics.fmean(t["reuse"] for t in rows) if rows else 0.0,
            "session_ttft_steps_mean": statistics.fmean(t["ttft_steps"] for t in rows) if rows else 0.0,
            "bg_hit_frac": self.bg_cached / self.bg_prompt if self.bg_prompt else 0.0,
            "bg_requests": self.bg_done,
            "bg_requests_per_kstep": 1000.0 * self.bg_done / step if step else 0.0,
            "bg_output_tokens_per_step": self.bg_out / step if step else 0.0,
            "all_hit_frac": self.all_cached / self.all_prompt if self.all_prompt else 0.0,   # both kinds
            "tokens_computed": self.computed,     # prefill + decode tokens run by the "model", all traffic
            "preemptions": self.sched.num_preemptions,
            "warm_demotions": kv.pool.warm_demotions,
            "evictions": st.evictions,
            "warm_blocks_end": kv.pool.num_warm,
        }


def default_cache_sizes(w: Workload) -> list[int]:
    """Three pressures, sized from the workload: the blocks background traffic holds at once, plus
    room for ~1/4, ~1/2 and ~all of the sessions' final histories."""
    bs = w.block_size
    bg_used = w.bg_concurrency * -(-(w.bg_prefix_tokens + w.bg_unique_tokens + w.bg_output_tokens) // bs)
    final = w.system_tokens + w.turns * (w.user_tokens + w.think_tokens + w.reply_tokens + 1)
    sess = w.sessions * -(-final // bs)
    return [bg_used + sess // 4, bg_used + sess // 2, bg_used + sess]


# With --think-tokens: a template that keeps thinking in history, one that strips it (Qwen3), and one
# that strips it with the history re-prefilled after each reply (what chatserve's sessions do).
REASONING_ARMS = (("kept", False, False), ("stripped", True, False), ("stripped+rewarm", True, True))


def run(workload: Workload | None = None, cache_sizes: list[int] | None = None, *,
        max_warm_fraction: float | None = None, starvation: bool = True, progress: bool = False) -> dict:
    """keep_warm off vs on at each cache size; plus a many-idle-sessions setting that checks whether
    the protected tier can crowd out the background traffic's cache, with the warm tier unbounded
    (max_warm_fraction 1.0) and with the manager's bound."""
    w = workload or Workload()
    sizes = cache_sizes or default_cache_sizes(w)
    runs = 2 * len(sizes) + (3 if starvation else 0) + (len(REASONING_ARMS) if w.think_tokens else 0)
    bar = progress_bar(runs, progress, desc="bench sessions", unit="run")

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
    if w.think_tokens:
        res["reasoning"] = [dict(one(replace(w, strip_thinking=strip, rewarm=rewarm), sizes[-1], True,
                                     max_warm_fraction), arm=arm) for arm, strip, rewarm in REASONING_ARMS]
    if bar is not None:
        bar.close()
    cfg = asdict(w)
    cfg["think_steps"] = list(w.think_steps)
    res["config"] = {**cfg, "cache_sizes": sizes, "max_warm_fraction": max_warm_fraction,
                     "manager_default_max_warm_fraction": KVCacheManager(1).max_warm_fraction,
                     **run_stamp()}
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
    if "reasoning" in res:
        lines.append(f"reasoning replies ({res['config']['think_tokens']} thinking + "
                     f"{res['config']['reply_tokens']} answer tokens), keep_warm on, the largest cache:")
        lines.append(f"{'history':>16} {'reuse of prev turn':>18} {'turn N+1 hit':>12} {'ceiling':>7} "
                     f"{'TTFT steps':>10} {'tokens computed':>15}")
        lines += [f"{r['arm']:>16} {r['session_reuse_mean']:>18.3f} {r['session_hit_frac']:>12.1%} "
                  f"{r['session_cacheable_frac']:>7.1%} {r['session_ttft_steps_mean']:>10.1f} "
                  f"{r['tokens_computed']:>15}" for r in res["reasoning"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("chatserve bench sessions", __doc__)
    d = Workload()
    ap.add_argument("--sessions", type=int, default=d.sessions)
    ap.add_argument("--turns", type=int, default=d.turns)
    ap.add_argument("--reply-tokens", type=int, default=d.reply_tokens)
    ap.add_argument("--user-tokens", type=int, default=d.user_tokens)
    ap.add_argument("--think-tokens", type=int, default=d.think_tokens,
                    help="thinking tokens before each answer: adds the kept / stripped / stripped+rewarm rows")
    ap.add_argument("--think-steps", default=f"{d.think_steps[0]},{d.think_steps[1]}",
                    help="MIN,MAX idle steps between turns")
    ap.add_argument("--bg-concurrency", type=int, default=d.bg_concurrency)
    ap.add_argument("--cache-sizes", default="", help="comma-separated block counts (default: 3 derived)")
    ap.add_argument("--max-warm-fraction", type=float, default=None,
                    help="share of blocks keep_warm may protect (default: the manager's; 1.0 = unbounded)")
    ap.add_argument("--no-starvation", action="store_true", help="skip the many-idle-sessions check")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.think_steps.split(","))
    w = replace(d, sessions=args.sessions, turns=args.turns, reply_tokens=args.reply_tokens,
                user_tokens=args.user_tokens, think_tokens=args.think_tokens, think_steps=(lo, hi),
                bg_concurrency=args.bg_concurrency, seed=args.seed)
    sizes = [int(x) for x in args.cache_sizes.split(",") if x] or None
    res = run(w, sizes, max_warm_fraction=args.max_warm_fraction, starvation=not args.no_starvation,
              progress=not args.no_progress)
    return print_result(res, args.json, _table)


if __name__ == "__main__":
    sys.exit(main())
