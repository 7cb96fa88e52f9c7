"""`chatserve bench scheduler`: the scheduler's own cost per step (schedule() + update()), no model.

Drives Scheduler + KVCacheManager with scripted runner outputs: a steady decode step with 256 running
sequences (goal < 1 ms) and a mixed step where new prompts are chunk-prefilled beside 256 decoders.
Building the RunnerOutput (the runner's job) is outside the timed region.
"""
from __future__ import annotations

import random
import statistics
import sys
import time

from chatserve.config import SchedulerConfig
from chatserve.bench.report import bench_parser, goal_table, goals_met, print_result, run_stamp
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import Request, SamplingParams
from chatserve.core.scheduler import Scheduler

GOALS: dict[str, tuple[str, float]] = {"decode_step_ms": ("<", 1.0)}   # key → (comparison, bound)


def _runner_output(out: SchedulerOutput, tok: int) -> RunnerOutput:
    return RunnerOutput(step_id=out.step_id,
                        sampled={s.request_id: tok for s in out.seqs if s.sample})


def _make(seqs: int, block_size: int, budget: int, max_len: int) -> Scheduler:
    blocks = seqs * (-(-max_len // block_size)) + 64
    kv = KVCacheManager(blocks, block_size, watermark=0.01, hash_seed=0)
    cfg = SchedulerConfig(max_num_seqs=seqs + 8, max_num_batched_tokens=budget,
                          max_waiting_requests=1 << 20, max_waiting_tokens=1 << 30)
    return Scheduler(cfg, kv, max_model_len=max_len)


def _add(sched: Scheduler, rng: random.Random, rid: str, prompt_len: int, max_tokens: int) -> None:
    prompt = [rng.randrange(1, 49152) for _ in range(prompt_len)]
    sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def _timed_steps(sched: Scheduler, steps: int, on_step=None) -> dict[str, list[float]]:
    """Run `steps` steps; per-step wall times of schedule() and update(), their CPU time, and the
    number of sequences scheduled."""
    t: dict[str, list[float]] = {"schedule": [], "update": [], "cpu": [], "seqs": []}
    clock, cpu = time.perf_counter, time.thread_time
    for k in range(steps):
        if on_step is not None:
            on_step(k)
        c0 = cpu()
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        c1 = cpu()
        res = _runner_output(out, 1000 + k % 7)
        c2 = cpu()
        t2 = clock()
        sched.update(out, res)
        t3 = clock()
        c3 = cpu()
        t["schedule"].append(t1 - t0)
        t["update"].append(t3 - t2)
        t["cpu"].append((c1 - c0) + (c3 - c2))
        t["seqs"].append(len(out.seqs))
    return t


def _summary(prefix: str, t: dict[str, list[float]]) -> dict:
    """The median step is the headline: on a shared machine the mean also measures other tenants."""
    tot = sorted(a + b for a, b in zip(t["schedule"], t["update"]))
    return {
        f"{prefix}_step_ms": 1e3 * statistics.median(tot),
        f"{prefix}_step_mean_ms": 1e3 * statistics.fmean(tot),
        f"{prefix}_step_p99_ms": 1e3 * tot[min(len(tot) - 1, int(0.99 * len(tot)))],
        f"{prefix}_step_cpu_ms": 1e3 * statistics.fmean(t["cpu"]),
        f"{prefix}_schedule_ms": 1e3 * statistics.median(t["schedule"]),
        f"{prefix}_update_ms": 1e3 * statistics.median(t["update"]),
        f"{prefix}_us_per_seq": 1e6 * statistics.median(tot) / max(1.0, statistics.fmean(t["seqs"])),
        f"{prefix}_seqs_per_step": statistics.fmean(t["seqs"]),
    }


def run(seqs: int = 256, steps: int = 300, *, block_size: int = 16, prompt_len: int = 128,
        budget: int = 2048, seed: int = 0) -> dict:
    rng = random.Random(seed)
    max_len = max(prompt_len + 2 * steps, 4 * prompt_len) + 64
    res: dict = {}

    # Steady decode: every sequence is past its prefill, one token each per step.
    sched = _make(seqs, block_size, budget, max_len)
    for i in range(seqs):
        _add(sched, rng, f"d{i}", prompt_len, 2 * steps + 32)
    while True:   # prefill everything first (several chunked steps)
        out = sched.schedule()
        sched.update(out, _runner_output(out, 7))
        if not sched.num_waiting and all(s.num_tokens == 1 for s in out.seqs):
            break
    _timed_steps(sched, 20)   # warm-up
    res.update(_summary("decode", _timed_steps(sched, steps)))

    # Mixed: 256 decoders plus a new prompt arriving every step, chunk-prefilled beside them.
    sched = _make(seqs + steps, block_size, budget, max_len)
    for i in range(seqs):
        _add(sched, rng, f"d{i}", prompt_len, 2 * steps + 32)
    for _ in range(64):
        out = sched.schedule()
        sched.update(out, _runner_output(out, 7))

    def arrive(k: int) -> None:
        _add(sched, rng, f"new{k}", 4 * prompt_len, 4)

    res.update(_summary("mixed", _timed_steps(sched, steps, arrive)))
    res["num_preemptions"] = sched.num_preemptions
    res["goals_met"] = goals_met(res, GOALS)
    res["config"] = {"seqs": seqs, "steps": steps, "block_size": block_size, "prompt_len": prompt_len,
                     "max_num_batched_tokens": budget, "seed": seed, **run_stamp()}
    return res


def _table(res: dict) -> str:
    rows = [
        ("decode_step_ms", "decode step, 256 seqs: schedule+update, p50 (ms)", "{:.3f}"),
        ("decode_step_mean_ms", "  mean (ms)", "{:.3f}"),
        ("decode_step_p99_ms", "  p99 (ms)", "{:.3f}"),
        ("decode_step_cpu_ms", "  CPU time, mean (ms)", "{:.3f}"),
        ("decode_schedule_ms", "  schedule() (ms)", "{:.3f}"),
        ("decode_update_ms", "  update() (ms)", "{:.3f}"),
        ("decode_us_per_seq", "  µs per sequence", "{:.2f}"),
        ("mixed_step_ms", "mixed step (decodes + chunked prefill), p50 (ms)", "{:.3f}"),
        ("mixed_step_p99_ms", "  p99 (ms)", "{:.3f}"),
        ("mixed_step_cpu_ms", "  CPU time, mean (ms)", "{:.3f}"),
        ("mixed_seqs_per_step", "  sequences per step", "{:.1f}"),
    ]
    return goal_table(res, rows, GOALS, label_width=50)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("chatserve bench scheduler", __doc__)
    ap.add_argument("--seqs", type=int, default=256, help="running sequences")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per scenario")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    res = run(args.seqs, args.steps, block_size=args.block_size, seed=args.seed)
    return print_result(res, args.json, _table)


if __name__ == "__main__":
    sys.exit(main())
