"""`chatserve bench serve`: an asyncio load generator for any OpenAI-compatible server (chatserve, vLLM).

Streams every request, measures TTFT/TPOT/ITL/E2E percentiles, throughput, goodput and the prefix-cache
hit rate (from /metrics). It does not start a server: point --url at a running one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from chatserve.bench import server_metrics, workloads
from chatserve.bench.progress import progress_bar
from chatserve.bench.sse_client import COMPLETED, StreamResult, first_model, make_client, stream_request
from chatserve.bench.workloads import Job, PromptSource


@dataclass
class Record:
    """One measured request."""

    job: str
    turn: int
    ok: bool
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    itls: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    error: str | None = None
    start_s: float = 0.0                 # when it was sent, since the run started
    token_times: list[float] = field(default_factory=list)   # choice 0's chunks, since the run started
    json_ok: bool | None = None          # the reply parses as JSON (requests with a response_format)


@dataclass
class RunOptions:
    endpoint: str = "chat"               # chat | completions
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = False
    concurrency: int | None = None       # None = unbounded
    request_rate: float = math.inf       # Poisson arrivals per second; inf = all at once
    seed: int = 0
    progress: bool = True
    stream_usage: bool = True            # ask for the final usage chunk (stream_options.include_usage)
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_body(job: Job, turn_idx: int, history: list[tuple[Any, str]], opts: RunOptions,
               tokenizer: Any = None) -> dict[str, Any]:
    """The request body for turn `turn_idx`; history holds (user, reply) pairs of earlier turns."""
    turn = job.turns[turn_idx]
    body: dict[str, Any] = {
        "model": opts.model,
        "stream": True,
        "max_tokens": turn.max_tokens,
        "temperature": opts.temperature,
    }
    if opts.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if job.n > 1:
        body["n"] = job.n
    if opts.ignore_eos:
        body["ignore_eos"] = True
    body.update(opts.extra_body)
    body.update(job.extra)               # per-job fields (the structured workload's response_format)
    if opts.endpoint == "chat":
        msgs: list[dict[str, str]] = []
        if job.system is not None:
            msgs.append({"role": "system", "content": _as_text(job.system, tokenizer)})
        for user, reply in history:
            msgs.append({"role": "user", "content": _as_text(user, tokenizer)})
            msgs.append({"role": "assistant", "content": reply})
        msgs.append({"role": "user", "content": _as_text(turn.user, tokenizer)})
        body["messages"] = msgs
    else:
        body["prompt"] = _completion_prompt(job, turn.user, history, tokenizer)
    return body


def _as_text(x: Any, tokenizer: Any) -> str:
    return x if isinstance(x, str) else tokenizer.decode(x)


def _completion_prompt(job: Job, user: Any, history: list[tuple[Any, str]], tokenizer: Any) -> Any:
    """Plain concatenation; a token-id list when the workload was built with a tokenizer."""
    if isinstance(user, list):
        ids: list[int] = list(job.system or [])  # type: ignore[arg-type]
        for u, reply in history:
            ids += list(u) + tokenizer.encode(reply)
        return ids + list(user)
    parts = [job.system] if job.system else []
    for u, reply in history:
        parts += [u, reply]
    parts.append(user)
    return "\n".join(parts)  # type: ignore[arg-type]


async def run_jobs(client: httpx.AsyncClient, jobs: list[Job], opts: RunOptions,
                   tokenizer: Any = None) -> tuple[list[Record], float]:
    """Send every job (Poisson arrivals or all at once, under the concurrency cap); return the
    per-request records and the wall-clock duration."""
    sem = asyncio.Semaphore(opts.concurrency) if opts.concurrency else None
    arrivals = random.Random(opts.seed + 1)
    path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
    total = sum(len(j.turns) for j in jobs)
    bar = progress_bar(total, opts.progress)
    records: list[Record] = []

    async def one(job: Job) -> None:
        history: list[tuple[Any, str]] = []
        if job.delay_s:
            await asyncio.sleep(job.delay_s)
        for i, turn in enumerate(job.turns):
            body = build_body(job, i, history, opts, tokenizer)
            sent = time.perf_counter() - start
            if sem is not None:
                async with sem:
                    res = await stream_request(client, path, body, chat=opts.endpoint == "chat",
                                               expected_n=job.n)
            else:
                res = await stream_request(client, path, body, chat=opts.endpoint == "chat",
                                           expected_n=job.n)
            records.append(_record(job, i, res, sent))
            if bar is not None:
                bar.update(1)
            if res.outcome != COMPLETED:
                if bar is not None:
                    bar.update(len(job.turns) - i - 1)
                return  # a conversation stops at its first failed turn
            history.append((turn.user, res.texts.get(0, "")))

    start = time.perf_counter()
    tasks = []
    for job in jobs:
        tasks.append(asyncio.create_task(one(job)))
        if math.isfinite(opts.request_rate) and opts.request_rate > 0:
            await asyncio.sleep(arrivals.expovariate(opts.request_rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return records, duration


def _record(job: Job, i: int, res: StreamResult, sent: float = 0.0) -> Record:
    ok = res.outcome == COMPLETED
    err = None
    if not ok:
        err = "; ".join(res.problems) or res.transport_error or (res.error or {}).get("message") \
            or f"{res.outcome} (HTTP {res.status})"
    prompt = res.prompt_tokens if res.prompt_tokens is not None else job.turns[i].approx_prompt_tokens
    json_ok = None
    if "response_format" in job.extra:
        try:
            json.loads(res.texts.get(0, ""))
            json_ok = ok
        except ValueError:
            json_ok = False
    return Record(job.tag, i, ok, res.ttft_s, res.tpot_s(), res.e2e_s, res.itls(),
                  res.output_tokens if ok else 0, prompt, res.cached_tokens, err, sent,
                  [sent + t for t in res.token_times.get(0, [])], json_ok)


def interference_summary(records: list[Record]) -> dict[str, Any]:
    """The interference workload's figures: the streams' ITLs while the "long" prompt is being
    prefilled (sent → first token) against their ITLs outside that window, and its TTFT."""
    long = next((r for r in records if r.job == "long" and r.ok and r.ttft_s is not None), None)
    if long is None:
        return {"long_ttft_ms": None, "itl_during_ms": _stats_ms([]), "itl_outside_ms": _stats_ms([])}
    lo, hi = long.start_s, long.start_s + long.ttft_s
    during, outside = [], []
    for r in records:
        if r.job.startswith("stream"):
            for a, b in zip(r.token_times, r.token_times[1:]):
                (during if b > lo and a < hi else outside).append(b - a)
    res = {"long_ttft_ms": long.ttft_s * 1e3, "itl_during_ms": _stats_ms(during),
           "itl_outside_ms": _stats_ms(outside)}
    base, hit = res["itl_outside_ms"]["p99"], res["itl_during_ms"]["p99"]
    res["itl_p99_ratio"] = hit / base if base and hit is not None else None
    return res


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(records: list[Record], duration: float, *, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Aggregate metrics of one run (times in ms, throughputs per second)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    d = max(duration, 1e-9)
    res: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / d,
        "output_token_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    if slo_ttft_ms is None and slo_tpot_ms is None:
        res["goodput"] = None
    else:
        good = [r for r in ok
                if (slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1e3 <= slo_ttft_ms))
                and (slo_tpot_ms is None or r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)]
        res["goodput"] = len(good) / d
        res["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "met": len(good)}
    with_cache = [r for r in ok if r.cached_tokens is not None]
    res["usage_cached_fraction"] = (
        sum(r.cached_tokens for r in with_cache) / max(1, sum(r.prompt_tokens for r in with_cache))  # type: ignore[misc]
        if with_cache else None)
    later = [r for r in with_cache if r.turn >= 1]
    res["usage_cached_fraction_turn2plus"] = (
        sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later))  # type: ignore[misc]
        if later else None)
    checked = [r for r in records if r.json_ok is not None]
    if checked:
        res["json_parsed"] = sum(bool(r.json_ok) for r in checked)
    res["errors"] = [r.error for r in records if not r.ok][:10]
    return res


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (all its threads), from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime + stime


async def reset_prefix_cache(client: httpx.AsyncClient) -> bool:
    """POST /reset_prefix_cache (chatserve, and vLLM in dev mode); False if the server lacks it."""
    try:
        r = await client.post("/reset_prefix_cache", timeout=30.0)
    except httpx.HTTPError:
        return False
    return r.status_code < 300


def make_jobs(args: argparse.Namespace, seed: int, tokenizer: Any) -> list[Job]:
    src = PromptSource(random.Random(seed), tokenizer)
    w = args.workload
    if w == "random":
        return workloads.random_jobs(src, args.num_prompts, args.input_len, args.output_len)
    if w == "shared-prefix":
        return workloads.shared_prefix_jobs(src, args.groups, args.prompts_per_group, args.system_len,
                                            args.question_len, args.output_len)
    if w == "multi-turn":
        return workloads.multi_turn_jobs(src, args.conversations, args.turns, args.turn_len,
                                         args.output_len, args.system_len if args.system_len_set else 0)
    if w == "parallel":
        return workloads.parallel_jobs(src, args.num_prompts, args.n, args.input_len, args.output_len)
    if w == "structured":
        return workloads.structured_jobs(src, args.num_prompts, args.input_len, args.output_len)
    if w == "interference":
        return workloads.interference_jobs(src, args.streams, args.input_len, args.output_len,
                                           args.long_len, args.long_output_len, args.long_delay)
    if w == "editing":
        return workloads.editing_jobs(src, args.num_prompts, args.input_len, args.output_len)
    raise ValueError(w)


async def run_structured(client: httpx.AsyncClient, args: argparse.Namespace, opts: RunOptions,
                         tokenizer: Any, seed: int) -> dict[str, Any]:
    """The structured workload against itself without the schema, in one run: each round sends the
    constrained requests, then as many unconstrained ones (other prompts, same lengths) that each
    generate exactly (ignore_eos) as many tokens as their constrained twin did. Both arms then see the
    same batch sizes, lengths and load, and the TPOT ratio is the grammar's cost."""
    arms: dict[str, tuple[list[Record], float]] = {"schema": ([], 0.0), "plain": ([], 0.0)}
    plain_opts = RunOptions(**{**opts.__dict__, "ignore_eos": True})
    for r in range(args.rounds):
        jobs = make_jobs(args, seed + 7919 * r, tokenizer)
        recs, dur = await run_jobs(client, jobs, opts, tokenizer)
        produced = {rec.job: rec.output_tokens for rec in recs if rec.ok and rec.output_tokens > 1}
        twins = make_jobs(args, seed + 7919 * r + 1, tokenizer)
        for twin in twins:
            twin.extra.pop("response_format", None)
            twin.turns[0].max_tokens = produced.get(twin.tag, twin.turns[0].max_tokens)
        p_recs, p_dur = await run_jobs(client, twins, plain_opts, tokenizer)
        arms["schema"] = (arms["schema"][0] + recs, arms["schema"][1] + dur)
        arms["plain"] = (arms["plain"][0] + p_recs, arms["plain"][1] + p_dur)
    res = summarize(*arms["schema"], slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot)
    plain = summarize(*arms["plain"])
    res["unconstrained"] = plain
    res["tpot_ratio"] = {k: (res["tpot_ms"][k] / plain["tpot_ms"][k]) if res["tpot_ms"][k] and plain["tpot_ms"][k]
                         else None for k in ("mean", "p50")}
    res["rounds"] = args.rounds
    return res


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of the command (one per --concurrency value)."""
    tokenizer = workloads.load_tokenizer(args.tokenizer) if args.tokenizer else None
    if tokenizer is not None and args.endpoint == "chat":
        args.endpoint = "completions"  # exact token ids need a token-list prompt
    levels = _concurrency_levels(args.concurrency)
    conns = max([c or 0 for c in levels] + [args.num_prompts, args.conversations, 1]) + 8
    async with make_client(args.url, api_key=args.api_key, connections=min(conns, 1024),
                           timeout=args.timeout) as client:
        model = args.model or await first_model(client)
        runs = []
        for k, c in enumerate(levels):
            opts = RunOptions(endpoint=args.endpoint, model=model, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, concurrency=c, request_rate=args.request_rate,
                              seed=args.seed + k, progress=not args.no_progress,
                              stream_usage=not args.no_stream_usage,
                              extra_body=json.loads(args.extra_body) if args.extra_body else {})
            if args.warmup and k == 0:
                src = PromptSource(random.Random(args.seed - 1), tokenizer)
                warm = workloads.random_jobs(src, args.warmup, "16", "8")
                await run_jobs(client, warm, RunOptions(**{**opts.__dict__, "progress": False,
                                                           "request_rate": math.inf}), tokenizer)
            reset = await reset_prefix_cache(client) if args.reset_prefix_cache else None
            if args.reset_prefix_cache and not reset:
                print("warning: the server has no POST /reset_prefix_cache", file=sys.stderr)
            before = await server_metrics.scrape(client)
            cpu0 = process_cpu_s(args.server_pid) if args.server_pid else None
            if args.workload == "structured":
                res = await run_structured(client, args, opts, tokenizer, args.seed + k)
            else:
                jobs = make_jobs(args, args.seed + k, tokenizer)
                records, duration = await run_jobs(client, jobs, opts, tokenizer)
                res = summarize(records, duration, slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot)
                if args.workload == "interference":
                    res["interference"] = interference_summary(records)
            cpu1 = process_cpu_s(args.server_pid) if args.server_pid else None
            after = await server_metrics.scrape(client)
            if cpu0 is not None and cpu1 is not None:
                res["server_cpu_s"] = cpu1 - cpu0
                res["server_cpu_ms_per_token"] = (cpu1 - cpu0) * 1e3 / max(1, res["output_tokens"])
            res.update({"workload": args.workload, "endpoint": args.endpoint, "model": model,
                        "url": args.url, "concurrency": c,
                        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                        "seed": args.seed + k, "prefix_cache_reset": reset,
                        "prefix_cache_hit_rate": server_metrics.prefix_hit_rate(before, after)})
            runs.append(res)
    return runs[0] if len(runs) == 1 else {"runs": runs}


def _concurrency_levels(spec: str | None) -> list[int | None]:
    if not spec:
        return [None]
    return [int(x) for x in str(spec).split(",") if x.strip()]


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Output tokens/s and TTFT (p50, p99) against concurrency, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] or 0 for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(xs, [r["output_token_throughput"] for r in runs], "o-")
    a1.set_xlabel("concurrency")
    a1.set_ylabel("output tokens/s")
    a1.set_title("throughput")
    a2.plot(xs, [r["ttft_ms"]["p50"] or 0 for r in runs], "o-", label="p50")
    a2.plot(xs, [r["ttft_ms"]["p99"] or 0 for r in runs], "s--", label="p99")
    a2.set_xlabel("concurrency")
    a2.set_ylabel("TTFT (ms)")
    a2.set_title("time to first token")
    a2.legend()
    for a in (a1, a2):
        if len(xs) > 1 and min(xs) > 0:
            a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
    name = runs[0].get("model", "")
    fig.suptitle(f"{runs[0].get('workload')} — {name} @ {runs[0].get('url')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_report(res: dict[str, Any]) -> str:
    lines = []
    for r in res.get("runs", [res]):
        lines.append(f"== {r['workload']} · {r['model']} · concurrency {r['concurrency'] or 'unbounded'}"
                     f" · rate {r['request_rate'] or 'inf'} ==")
        lines.append(f"requests: {r['completed']}/{r['num_requests']} ok in {r['duration_s']:.2f} s")
        lines.append(f"throughput: {r['request_throughput']:.2f} req/s, "
                     f"{r['output_token_throughput']:.1f} output tok/s, "
                     f"{r['total_token_throughput']:.1f} total tok/s")
        if r.get("goodput") is not None:
            lines.append(f"goodput: {r['goodput']:.2f} req/s within SLO")
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = r[key]
            if s["p50"] is None:
                lines.append(f"{key:8s} n/a")
            else:
                lines.append(f"{key:8s} mean {s['mean']:9.1f}  p50 {s['p50']:9.1f}  "
                             f"p90 {s['p90']:9.1f}  p99 {s['p99']:9.1f}")
        hr = r.get("prefix_cache_hit_rate")
        lines.append("prefix cache hit rate: " + ("n/a" if hr is None else f"{hr:.1%}"))
        if r.get("server_cpu_ms_per_token") is not None:
            lines.append(f"server CPU: {r['server_cpu_s']:.2f} s, {r['server_cpu_ms_per_token']:.3f} ms "
                         f"per streamed token")
        cf = r.get("usage_cached_fraction_turn2plus")
        if cf is not None:
            lines.append(f"cached prompt tokens from turn 2 on: {cf:.1%}")
        it = r.get("interference")
        if it and it["long_ttft_ms"] is not None:
            d, o = it["itl_during_ms"], it["itl_outside_ms"]
            lines.append(f"long prompt TTFT {it['long_ttft_ms']:.1f} ms; streams' ITL p50/p99 during its "
                         f"prefill {d['p50'] or 0:.1f}/{d['p99'] or 0:.1f} ms, outside "
                         f"{o['p50'] or 0:.1f}/{o['p99'] or 0:.1f} ms")
        if r.get("json_parsed") is not None:
            lines.append(f"replies that parse as JSON: {r['json_parsed']}/{r['completed']}")
        plain = r.get("unconstrained")
        if plain is not None:
            t = plain["tpot_ms"]
            lines.append(f"unconstrained twins ({plain['completed']}/{plain['num_requests']} ok, "
                         f"{plain['output_tokens']} tokens): tpot_ms mean "
                         + ("n/a" if t["p50"] is None else f"{t['mean']:.1f}  p50 {t['p50']:.1f}"))
            q = r["tpot_ratio"]
            lines.append("TPOT with / without the schema: "
                         + ", ".join(f"{k} {v:.3f}" if v else f"{k} n/a" for k, v in q.items()))
        for e in r.get("errors") or []:
            lines.append(f"  error: {e}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench serve", description=__doc__)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn", "parallel", "structured",
                                          "interference", "editing"),
                   default="random", help="editing: fix the typos in a given text of --input-len words")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="128", help="tokens, N or MIN:MAX")
    p.add_argument("--output-len", default="128", help="tokens, N or MIN:MAX")
    p.add_argument("--groups", type=int, default=4, help="shared-prefix: groups")
    p.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: prompts per group")
    p.add_argument("--system-len", type=int, default=None,
                   help="shared-prefix: shared system prompt tokens (default 1024); multi-turn: optional")
    p.add_argument("--question-len", default="32", help="shared-prefix: per-prompt tokens")
    p.add_argument("--conversations", type=int, default=8, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--turn-len", default="64", help="multi-turn: user message tokens")
    p.add_argument("--n", type=int, default=4, help="parallel: samples per prompt")
    p.add_argument("--streams", type=int, default=4,
                   help="interference: chats decoding (--input-len in, --output-len out)")
    p.add_argument("--long-len", type=int, default=4000, help="interference: the long prompt's tokens")
    p.add_argument("--long-output-len", type=int, default=64, help="interference: the long prompt's max_tokens")
    p.add_argument("--long-delay", type=float, default=2.0,
                   help="interference: seconds after the streams start that the long prompt is sent")
    p.add_argument("--rounds", type=int, default=2,
                   help="structured: rounds of constrained requests, each followed by its unconstrained twins")
    p.add_argument("--concurrency", default=None,
                   help="max requests in flight; a list like 1,4,16 runs once per value")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (default inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="short requests sent first, not measured")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="POST /reset_prefix_cache before each measured run")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/chatserve extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, HF dir, GGUF, or 'default': exact token-id prompts via /v1/completions")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT target, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT target, ms")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", default=None, help="write the JSON results to FILE")
    p.add_argument("--plot", default=None, help="PNG of throughput and TTFT vs concurrency")
    p.add_argument("--no-stream-usage", action="store_true",
                   help="do not send stream_options (servers that reject it); tokens are then counted per chunk")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--server-pid", type=int, default=None,
                   help="a local server's process id: report its CPU time per streamed token over each run")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.system_len_set = args.system_len is not None
    if args.system_len is None:
        args.system_len = 1024
    try:
        res = asyncio.run(run(args))
    except (httpx.HTTPError, RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"chatserve bench serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(res.get("runs", [res]), args.plot)
    print(text if args.json else format_report(res))
    runs = res.get("runs", [res])
    return 0 if all(r["completed"] == r["num_requests"] for r in runs) else 3
