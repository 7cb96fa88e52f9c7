"""Reads a server's Prometheus `/metrics` for the benchmarks: prefix-cache counters, queue and KV gauges.

Parses the exposition text with prometheus_client's own parser and sums each sample name over its
label sets. Names are looked up under `chatserve:` first, then `vllm:`, so the same run can measure
either server. Not a scraper for dashboards (Prometheus does that).
"""
from __future__ import annotations

import asyncio
import math
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("chatserve:", "vllm:")

# Gauges that give the count of KV blocks in use / in total. Issue 5 names only
# kv_cache_usage_perc; these are the block-count gauges the load tool reads when present.
USED_BLOCKS = ("kv_cache_used_blocks", "num_kv_blocks_used", "kv_cache_blocks_used")
TOTAL_BLOCKS = ("kv_cache_total_blocks", "num_kv_blocks", "kv_cache_num_blocks", "num_gpu_blocks")


def parse(text: str) -> dict[str, float]:
    """sample name -> value summed over label sets; `*_info` labels holding numbers are kept as
    `name{label}` entries too (vLLM reports num_gpu_blocks as a label of cache_config_info).
    Text that is not the exposition format gives {}."""
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
                if sample.name.endswith("_info"):
                    for k, v in sample.labels.items():
                        try:
                            out[f"{sample.name}{{{k}}}"] = float(v)
                        except ValueError:
                            pass
    except ValueError:
        return {}
    return out


def lookup(metrics: dict[str, float] | None, *names: str) -> float | None:
    """First of `names` found under any known prefix (chatserve:, then vllm:)."""
    if not metrics:
        return None
    for name in names:
        for prefix in PREFIXES:
            v = metrics.get(prefix + name)
            if v is not None and not math.isnan(v):
                return v
    return None


async def scrape(client: httpx.AsyncClient) -> dict[str, float] | None:
    """GET /metrics; None when the server has none (404, not Prometheus text, unreachable)."""
    try:
        r = await client.get("/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    m = parse(r.text)
    return m or None


def prefix_hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Prefix-cache hit rate (tokens) between two scrapes; None when the server lacks the counters."""
    q0 = lookup(before, "prefix_cache_queries_total", "gpu_prefix_cache_queries_total")
    q1 = lookup(after, "prefix_cache_queries_total", "gpu_prefix_cache_queries_total")
    h0 = lookup(before, "prefix_cache_hits_total", "gpu_prefix_cache_hits_total")
    h1 = lookup(after, "prefix_cache_hits_total", "gpu_prefix_cache_hits_total")
    if q0 is None or q1 is None or h0 is None or h1 is None:
        return None
    dq = q1 - q0
    return (h1 - h0) / dq if dq > 0 else None


def blocks_in_use(m: dict[str, float] | None) -> int | None:
    """KV blocks in use: a used-blocks gauge if exported, else usage × total blocks, else 0 when
    usage is exactly 0; None when it cannot be known."""
    used = lookup(m, *USED_BLOCKS)
    if used is not None:
        return int(round(used))
    usage = lookup(m, "kv_cache_usage_perc", "gpu_cache_usage_perc")
    if usage is None:
        return None
    if usage == 0:
        return 0
    frac = usage / 100.0 if usage > 1.0 else usage  # vLLM reports a fraction despite the name
    total = lookup(m, *TOTAL_BLOCKS)
    if total is None and m:
        total = m.get("vllm:cache_config_info{num_gpu_blocks}")
    return int(round(frac * total)) if total else None


async def wait_idle(client: httpx.AsyncClient, timeout: float = 30.0,
                    settle: float = 0.5) -> dict[str, float] | None:
    """Poll /metrics until nothing runs or waits, twice `settle` apart (or timeout); return the last scrape."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = await scrape(client)
        if last is None:
            return None
        running = lookup(last, "num_requests_running") or 0
        waiting = lookup(last, "num_requests_waiting") or 0
        if running == 0 and waiting == 0:
            await asyncio.sleep(settle)
            again = await scrape(client)
            if again is None:
                return last
            # idle only if it still is after the settle (another client may have started work meanwhile)
            if not (lookup(again, "num_requests_running") or 0) and not (lookup(again, "num_requests_waiting") or 0):
                return again
            last = again
        if time.monotonic() > deadline:
            return last
        await asyncio.sleep(0.2)
