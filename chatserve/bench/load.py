"""`chatserve bench load`: a bounded stress test that cancels a fraction of streams and validates all of them.

Every request is a streamed chat completion of mixed length; each stream is judged (valid SSE, role
chunk first, one finish_reason per choice or one error event, [DONE] last) and counted; once the
server is idle, KV blocks still in use are read from /metrics. The verdict is ok, failed, or unverified
(exit 0, 3, 4) when the metrics cannot show leaks. It measures; it does not start a server.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from chatserve.bench import server_metrics
from chatserve.bench.progress import progress_bar
from chatserve.bench.report import run_to_results
from chatserve.bench.sse_client import (CANCELLED, COMPLETED, ERRORED, INVALID, REJECTED, SERVER_ERROR,
                                        TRANSPORT, StreamResult, first_model, make_client, stream_request)
from chatserve.bench.workloads import PromptSource, parse_range


OK, FAILED, UNVERIFIED = "ok", "failed", "unverified"
EXIT = {OK: 0, FAILED: 3, UNVERIFIED: 4}


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    src = PromptSource(rng)
    plo, phi = parse_range(args.prompt_len)
    mlo, mhi = parse_range(args.max_tokens)
    results: list[StreamResult] = []
    sent = 0
    bar = progress_bar(args.max_requests or None, not args.no_progress, desc="bench load")
    deadline = time.monotonic() + args.duration

    async with make_client(args.url, api_key=args.api_key, connections=args.concurrency + 8,
                           timeout=args.request_timeout) as client:
        model = args.model or await first_model(client)

        def next_request() -> tuple[dict[str, Any], int | None] | None:
            nonlocal sent
            if time.monotonic() >= deadline or (args.max_requests and sent >= args.max_requests):
                return None
            sent += 1
            body = {"model": model, "stream": True, "max_tokens": rng.randint(mlo, mhi),
                    "temperature": args.temperature,
                    "messages": [{"role": "user", "content": src.text(rng.randint(plo, phi))}]}
            if args.ignore_eos:
                body["ignore_eos"] = True
            cancel = rng.randint(1, 4) if rng.random() < args.cancel_fraction else None
            return body, cancel

        async def worker() -> None:
            while (nxt := next_request()) is not None:
                body, cancel = nxt
                res = await stream_request(client, "/v1/chat/completions", body, chat=True,
                                           cancel_after_chunks=cancel)
                results.append(res)
                if bar is not None:
                    bar.update(1)
                if res.outcome == REJECTED and res.status in (429, 503):
                    # back off as told (capped), so a refused client does not spin
                    await asyncio.sleep(min(_retry_after(res.retry_after), args.max_backoff))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        idle = await server_metrics.wait_idle(client, timeout=args.idle_timeout)
    return _report(args, model, duration, results, idle)


def _report(args: argparse.Namespace, model: str, duration: float, results: list[StreamResult],
            idle: dict[str, float] | None) -> dict[str, Any]:
    """The run's figures from every stream's result and the server's metrics once idle."""
    counts = Counter(r.outcome for r in results)
    samples = [f"HTTP {r.status} {r.outcome}: " + "; ".join(r.problems[:3]) for r in results if r.problems][:10]
    accepted = [r for r in results if r.status == 200]
    rejected = [r for r in results if r.outcome == REJECTED]
    overload = [r.headers_s for r in results if r.status == 503 and r.headers_s is not None]
    ttfts = [r.ttft_s for r in accepted if r.ttft_s is not None and r.outcome in (COMPLETED, CANCELLED)]
    leaked = server_metrics.blocks_in_use(idle)
    lost = sum(1 for r in accepted if r.outcome == INVALID)
    server_errors = counts[SERVER_ERROR]
    out = {
        "url": args.url,
        "model": model,
        "concurrency": args.concurrency,
        "duration_s": duration,
        "requests_sent": len(results),
        "accepted": len(accepted),
        "completed": counts[COMPLETED],
        "cancelled": counts[CANCELLED],
        "errored": counts[ERRORED],             # ended by one proper error event
        "rejected": len(rejected),
        "rejected_without_retry_after": sum(1 for r in rejected if r.status == 503 and not r.retry_after),
        "server_errors": server_errors,
        "lost": lost,
        "invalid_refusals": sum(1 for r in results if r.status not in (None, 200) and r.outcome == INVALID),
        "transport_errors": counts[TRANSPORT],
        "leaked_blocks": leaked,
        "kv_cache_usage_idle": server_metrics.lookup(idle, "kv_cache_usage_perc", "gpu_cache_usage_perc"),
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p99": _pct(ttfts, 99),
        "overload_503_count": len(overload),
        "overload_503_latency_ms": _pct(overload, 99),
        "overload_503_latency_ms_p50": _pct(overload, 50),
        "output_tokens": sum(r.output_tokens for r in accepted),
        "problems": samples,
    }
    failed = bool(lost or server_errors or out["transport_errors"] or out["invalid_refusals"] or leaked)
    # a leak the server's metrics cannot show is not a pass: the run is unverified
    out["verdict"] = FAILED if failed else (UNVERIFIED if leaked is None else OK)
    out["ok"] = out["verdict"] == OK
    return out


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.05
    except ValueError:
        return 0.05


def format_report(r: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f} ms"

    return "\n".join([
        f"== load · {r['model']} · {r['concurrency']} streams · {r['duration_s']:.1f} s ==",
        f"sent {r['requests_sent']}: accepted {r['accepted']} (completed {r['completed']}, "
        f"cancelled {r['cancelled']}, errored {r['errored']}, lost {r['lost']}), rejected {r['rejected']}, "
        f"server errors {r['server_errors']}, transport errors {r['transport_errors']}",
        f"TTFT p50 {ms(r['ttft_p50'])}, p99 {ms(r['ttft_p99'])}; "
        f"503 answers: {r['overload_503_count']} (p99 {ms(r['overload_503_latency_ms'])})",
        "leaked KV blocks once idle: " + (str(r["leaked_blocks"]) if r["leaked_blocks"] is not None
                                          else "unknown (the server's /metrics show no KV usage)"),
        *[f"  problem: {p}" for p in r["problems"]],
        "verdict: " + r["verdict"].upper() + (": leaks not verified" if r["verdict"] == UNVERIFIED else ""),
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench load", description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration", type=float, default=30.0, help="seconds during which requests start")
    p.add_argument("--concurrency", type=int, default=32, help="streams in flight")
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="fraction cancelled mid-stream")
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many (0 = no cap)")
    p.add_argument("--prompt-len", default="4:200", help="user message words, N or MIN:MAX")
    p.add_argument("--max-tokens", default="4:64", help="max_tokens, N or MIN:MAX")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--idle-timeout", type=float, default=30.0, help="wait this long for the server to go idle")
    p.add_argument("--max-backoff", type=float, default=0.25, help="cap on the Retry-After sleep, s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.cancel_fraction <= 1.0 or args.concurrency < 1:
        print("chatserve bench load: --cancel-fraction in [0, 1], --concurrency >= 1", file=sys.stderr)
        return 2
    res = run_to_results("load", run, args, format_report)
    return 1 if res is None else EXIT[res["verdict"]]
