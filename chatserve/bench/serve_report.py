"""`bench serve`'s figures: the record of one measured request, and a run's records → TTFT/TPOT/ITL/E2E
percentiles, throughput, goodput, cached-token fractions and the interference window; the text report
and the plot. Only arithmetic and formatting; the runs themselves are serve.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    chunks: int = 0                      # content chunks that arrived (all choices)
    retokenized: int | None = None       # the text that arrived re-encoded (with --tokenizer)
    usage_tokens: int | None = None      # the server's usage.completion_tokens

    def usage_mismatch(self) -> bool:
        """The server's count contradicts what arrived: fewer tokens than content chunks (each chunk
        carries at least one token), or, with a tokenizer, off the re-encoded text by more than 10 % + 1
        (re-encoding a text need not give back the same tokens, but never a very different number)."""
        if self.usage_tokens is None or not self.ok:
            return False
        if self.usage_tokens < self.chunks:
            return True
        return self.retokenized is not None and abs(self.usage_tokens - self.retokenized) > 1 + 0.1 * self.usage_tokens


def interference_summary(records: list[Record]) -> dict[str, Any]:
    """The interference workload's figures: the streams' ITLs while the "long" prompt is being
    prefilled (sent → first token) against their ITLs outside that window, its TTFT, and whether every
    stream was still decoding when that window closed (streams that end first measure less of it)."""
    long = next((r for r in records if r.job == "long" and r.ok and r.ttft_s is not None), None)
    if long is None:
        return {"long_ttft_ms": None, "itl_during_ms": _stats_ms([]), "itl_outside_ms": _stats_ms([])}
    ttft = long.ttft_s
    assert ttft is not None                     # the filter above
    lo, hi = long.start_s, long.start_s + ttft
    during: list[float] = []
    outside: list[float] = []
    for r in records:
        if r.job.startswith("stream"):
            for a, b in zip(r.token_times, r.token_times[1:]):
                (during if b > lo and a < hi else outside).append(b - a)
    streams = [r for r in records if r.job.startswith("stream")]
    res: dict[str, Any] = {"long_ttft_ms": ttft * 1e3, "itl_during_ms": _stats_ms(during),
                           "itl_outside_ms": _stats_ms(outside),
                           "streams_span_prefill": all(r.token_times and r.token_times[-1] >= hi for r in streams)}
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
        sum(r.cached_tokens or 0 for r in with_cache) / max(1, sum(r.prompt_tokens for r in with_cache))
        if with_cache else None)
    later = [r for r in with_cache if r.turn >= 1]
    res["usage_cached_fraction_turn2plus"] = (
        sum(r.cached_tokens or 0 for r in later) / max(1, sum(r.prompt_tokens for r in later))
        if later else None)
    res.update(_token_counts(ok))
    checked = [r for r in records if r.json_ok is not None]
    if checked:
        res["json_parsed"] = sum(bool(r.json_ok) for r in checked)
    res["errors"] = [r.error for r in records if not r.ok][:10]
    return res


def _token_counts(ok: list[Record]) -> dict[str, Any]:
    """What arrived (chunks; the text re-encoded when a tokenizer was given) beside the server's usage,
    and the requests whose usage contradicts what arrived."""
    retok = [r.retokenized for r in ok if r.retokenized is not None]
    usage = [r.usage_tokens for r in ok if r.usage_tokens is not None]
    bad = [r for r in ok if r.usage_mismatch()]
    return {
        "output_chunks": sum(r.chunks for r in ok),
        "output_tokens_retokenized": sum(retok) if retok else None,
        "usage_completion_tokens": sum(usage) if usage else None,
        "usage_reported": f"{len(usage)}/{len(ok)}",
        "usage_mismatches": len(bad),
        "usage_mismatch_examples": [f"{r.job} turn {r.turn}: usage {r.usage_tokens}, chunks {r.chunks}, "
                                    f"re-encoded {r.retokenized}" for r in bad[:5]],
    }


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


def _counts_line(r: dict[str, Any]) -> str:
    s = f"output tokens arrived: {r['output_chunks']} chunks"
    if r.get("output_tokens_retokenized") is not None:
        s += f", {r['output_tokens_retokenized']} re-encoded"
    u = r.get("usage_completion_tokens")
    s += "; server usage: " + ("none" if u is None else f"{u} ({r['usage_reported']} requests)")
    if r.get("usage_mismatches"):
        s += f"; MISMATCH in {r['usage_mismatches']} requests: " + "; ".join(r["usage_mismatch_examples"])
    return s


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
        lines.append(_counts_line(r))
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
            if d["p50"] is None:
                during = "none arrived during its prefill (the streams ended first: raise --output-len)"
            else:
                during = f"ITL p50/p99 during its prefill {d['p50']:.1f}/{d['p99']:.1f} ms"
                if not it.get("streams_span_prefill", True):
                    during += " (some streams ended before its first token: raise --output-len)"
            lines.append(f"long prompt TTFT {it['long_ttft_ms']:.1f} ms; streams' {during}, outside "
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
