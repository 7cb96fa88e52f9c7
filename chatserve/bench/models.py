"""`chatserve bench models`: model switching on a server that serves several (docs/multi-model.md).

1. cold vs warm TTFT: for each model, unload it (a request with keep_alive 0, then /v1/models until it
   says unloaded), time the first streamed request (= load + prefill), then the same request again warm.
2. alternating: `--streams` concurrent streams per model, each sending `--requests` streamed requests in
   turn, both models at once; a 503 (no room: the other model's requests hold memory) is retried after its
   Retry-After. Every stream is validated (sse_client); "lost" counts requests that never completed.
It measures; it does not start a server.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx

from chatserve.bench.report import run_stamp, run_to_results
from chatserve.bench.sse_client import COMPLETED, REJECTED, make_client, stream_request

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


def _body(model: str, max_tokens: int, keep_alive: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    return body


async def _status(client: httpx.AsyncClient) -> dict[str, str]:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return {m["id"]: m.get("status", "loaded") for m in r.json()["data"]}


async def _unload(client: httpx.AsyncClient, model: str) -> None:
    await stream_request(client, "/v1/chat/completions", _body(model, 1, keep_alive=0))
    for _ in range(600):
        if (await _status(client)).get(model) == "unloaded":
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{model} did not unload (is it the server's only model?)")


async def cold_warm(client: httpx.AsyncClient, model: str, rounds: int, max_tokens: int) -> dict[str, Any]:
    cold: list[float] = []
    warm: list[float] = []
    for _ in range(rounds):
        await _unload(client, model)
        for out in (cold, warm):
            res = await stream_request(client, "/v1/chat/completions", _body(model, max_tokens, keep_alive=-1))
            if res.outcome != COMPLETED or res.ttft_s is None:
                raise RuntimeError(f"{model}: {res.outcome} {res.problems or res.error}")
            out.append(res.ttft_s)
    return {"cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
            "cold_all_s": cold, "warm_all_s": warm}


async def alternating(client: httpx.AsyncClient, models: list[str], streams: int, requests: int,
                      max_tokens: int, max_backoff: float) -> dict[str, Any]:
    counts = {m: {"completed": 0, "refused_503": 0, "lost": 0, "invalid": 0} for m in models}

    async def worker(model: str) -> None:
        c = counts[model]
        for _ in range(requests):
            for _attempt in range(200):
                res = await stream_request(client, "/v1/chat/completions", _body(model, max_tokens))
                if res.outcome == REJECTED and res.status == 503:
                    c["refused_503"] += 1
                    await asyncio.sleep(min(max_backoff, float(res.retry_after or 1)))
                    continue
                if res.outcome == COMPLETED and not res.problems:
                    c["completed"] += 1
                else:
                    c["invalid"] += 1
                break
            else:
                c["lost"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(m) for m in models for _ in range(streams)))
    return {"models": counts, "seconds": time.perf_counter() - t0, "streams_per_model": streams,
            "requests_per_stream": requests,
            "lost": sum(c["lost"] + c["invalid"] for c in counts.values())}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with make_client(args.url, api_key=args.api_key, connections=4 * args.streams + 8) as client:
        names = list(await _status(client))
        models = args.models.split(",") if args.models else names[:2]
        if len(models) < 2:
            raise RuntimeError("the server serves one model: start it with --model NAME=PATH twice")
        res: dict[str, Any] = {"url": args.url, **run_stamp(), "cold_warm": {}}
        for m in models:
            res["cold_warm"][m] = await cold_warm(client, m, args.rounds, args.max_tokens)
        res["alternating"] = await alternating(client, models, args.streams, args.requests, args.max_tokens,
                                               args.max_backoff)
    return res


def format_report(r: dict[str, Any]) -> str:
    lines = ["model switching", f"  {'model':<16} {'cold TTFT (load + prefill)':>28} {'warm TTFT':>12}"]
    for m, cw in r["cold_warm"].items():
        lines.append(f"  {m:<16} {cw['cold_ttft_s'] * 1000:>25.0f} ms {cw['warm_ttft_s'] * 1000:>9.0f} ms")
    a = r["alternating"]
    lines.append(f"  alternating: {a['streams_per_model']} streams per model × {a['requests_per_stream']} requests, "
                 f"{a['seconds']:.1f} s")
    for m, c in a["models"].items():
        lines.append(f"    {m:<16} completed {c['completed']}, refused (503, retried) {c['refused_503']}, "
                     f"invalid {c['invalid']}, lost {c['lost']}")
    lines.append(f"  lost requests: {a['lost']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--models", default=None, help="two served names, comma-separated (default: the first two)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rounds", type=int, default=3, help="cold/warm pairs per model (medians reported)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--streams", type=int, default=8, help="concurrent streams per model when alternating")
    p.add_argument("--requests", type=int, default=4, help="requests each stream sends in turn")
    p.add_argument("--max-backoff", type=float, default=1.0, help="cap on the Retry-After sleep, s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    res = run_to_results("models", run, args, format_report)
    return 1 if res is None else 0 if res["alternating"]["lost"] == 0 else 3
