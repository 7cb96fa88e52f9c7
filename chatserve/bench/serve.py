"""`chatserve bench serve`: an asyncio load generator for any OpenAI-compatible server (chatserve, vLLM).

Streams every request and records its timings and the output tokens that arrived (content chunks, and
the text re-encoded with --tokenizer) beside the server's usage; serve_report.py turns the records into
TTFT/TPOT/ITL/E2E percentiles, throughput and goodput, beside the prefix-cache hit rate (from /metrics).
It does not start a server: point --url at a running one.
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

from chatserve.bench import server_metrics, workloads
from chatserve.bench.progress import progress_bar
from chatserve.bench.report import write_results
from chatserve.bench.serve_report import Record, format_report, interference_summary, plot, summarize
from chatserve.bench.sse_client import COMPLETED, StreamResult, first_model, make_client, stream_request
from chatserve.bench.workloads import Job, PromptSource


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
        ids: list[int] = list(job.system or [])  # type: ignore[arg-type]  # Job.system is str | list[int]: ids here
        for u, reply in history:
            ids += list(u) + tokenizer.encode(reply)
        return ids + list(user)
    parts = [job.system] if job.system else []
    for u, reply in history:
        parts += [u, reply]
    parts.append(user)
    return "\n".join(parts)  # type: ignore[arg-type]  # text workload: every part is a str here


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
            records.append(_record(job, i, res, sent, tokenizer))
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


def _record(job: Job, i: int, res: StreamResult, sent: float = 0.0, tokenizer: Any = None) -> Record:
    """One request's figures. Output tokens are counted from what arrived: the text re-encoded when a
    tokenizer is given, else the content chunks; the server's usage is kept beside them."""
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
    retok = res.retokenized(tokenizer) if tokenizer is not None and ok else None
    arrived = retok if retok is not None else res.output_tokens
    return Record(job.tag, i, ok, res.ttft_s, res.tpot_s(), res.e2e_s, res.itls(),
                  arrived if ok else 0, prompt, res.cached_tokens, err, sent,
                  [sent + t for t in res.token_times.get(0, [])], json_ok,
                  chunks=res.content_chunks if ok else 0, retokenized=retok, usage_tokens=res.usage_tokens)


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
    constrained requests, then their unconstrained twins (the same prompts, each generating exactly, with
    ignore_eos, as many tokens as its constrained request did), the prefix cache reset before each arm.
    Both arms then see the same prompts, cache state, batch sizes and reply lengths, and the TPOT ratio
    is the grammar's cost."""
    arms: dict[str, tuple[list[Record], float]] = {"schema": ([], 0.0), "plain": ([], 0.0)}
    plain_opts = RunOptions(**{**opts.__dict__, "ignore_eos": True})
    resets = 0
    for r in range(args.rounds):
        jobs = make_jobs(args, seed + 7919 * r, tokenizer)
        resets += await reset_prefix_cache(client)
        recs, dur = await run_jobs(client, jobs, opts, tokenizer)
        produced = {rec.job: n for rec in recs if rec.ok and (n := rec.usage_tokens or rec.output_tokens) > 1}
        twins = make_jobs(args, seed + 7919 * r, tokenizer)          # the same prompts
        for twin in twins:
            twin.extra.pop("response_format", None)
            twin.turns[0].max_tokens = produced.get(twin.tag, twin.turns[0].max_tokens)
        resets += await reset_prefix_cache(client)
        p_recs, p_dur = await run_jobs(client, twins, plain_opts, tokenizer)
        arms["schema"] = (arms["schema"][0] + recs, arms["schema"][1] + dur)
        arms["plain"] = (arms["plain"][0] + p_recs, arms["plain"][1] + p_dur)
    res = summarize(*arms["schema"], slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot)
    plain = summarize(*arms["plain"])
    res["unconstrained"] = plain
    res["tpot_ratio"] = {k: (res["tpot_ms"][k] / plain["tpot_ms"][k]) if res["tpot_ms"][k] and plain["tpot_ms"][k]
                         else None for k in ("mean", "p50")}
    res["rounds"] = args.rounds
    res["prefix_cache_resets"] = resets
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
    if args.plot:
        plot(res.get("runs", [res]), args.plot)
    write_results(res, args.out, args.json, format_report)
    runs = res.get("runs", [res])
    return 0 if all(r["completed"] == r["num_requests"] for r in runs) else 3
