"""Decode steps of the default model with and without a JSON schema, the mask inline or during the forward.

`python -m chatserve.bench.grammar_steps` drives ModelRunner directly (no server): B rows decode side by
side at temperature 1 with per-row seeds, in three modes whose steps alternate in one run (plain, schema
with the mask on the step thread, schema with the mask prefetched during the forward); prints wall and
step-thread CPU ms per step, the mask's cost per token, grammar compile time, and checks that both schema
modes sample the same tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

MODES = ("plain", "inline", "overlap")


class _Rows:
    """B decoding rows; a row whose reply ends (EOS) starts a new reply (a new request) in place."""

    def __init__(self, b: int, prompt: list[int], first_block: int, blocks_per_row: int, mode: str, spec: Any,
                 params_cls: Any, seq_cls: Any) -> None:
        self.mode, self.spec, self.P, self.S = mode, spec, params_cls, seq_cls
        self.tokens = [list(prompt) for _ in range(b)]          # prompt + every sampled token, per row
        self.reply_start = [len(prompt)] * b
        self.reply_no = [0] * b
        self.tables = [list(range(first_block + r * blocks_per_row, first_block + (r + 1) * blocks_per_row))
                       for r in range(b)]
        self.finished: list[str] = []
        self.replies: dict[str, list[int]] = {}

    def rid(self, r: int) -> str:
        return f"{self.mode}-{r}-{self.reply_no[r]}"

    def step(self, prefill: bool) -> list[Any]:
        params = self.P(temperature=1.0, max_tokens=1 << 20, structured=self.spec if self.mode != "plain" else None)
        seqs = []
        for r, toks in enumerate(self.tokens):
            start = 0 if prefill else len(toks) - 1
            seqs.append(self.S(request_id=self.rid(r), token_ids=toks[start:], start_pos=start,
                               block_table=self.tables[r], sample=True, params=params,
                               output_token_ids=toks[self.reply_start[r]:], seed=1000 * r + self.reply_no[r]))
        return seqs

    def feed(self, sampled: dict[str, int], eos: set[int]) -> None:
        for r, toks in enumerate(self.tokens):
            rid = self.rid(r)
            toks.append(sampled[rid])
            if sampled[rid] in eos:
                self.replies[rid] = toks[self.reply_start[r]:]
                self.finished.append(rid)
                self.reply_no[r] += 1
                self.reply_start[r] = len(toks)


def blocks_per_row(runner: Any, prompt_len: int, steps: int) -> int:
    return -(-(prompt_len + steps + 1) // runner.block_size)


def measure(runner: Any, spec: Any, prompt: list[int], b: int, steps: int, eos: set[int]
            ) -> dict[str, dict[str, Any]]:
    """Every mode's B rows, their steps interleaved (plain, inline, overlap, plain, …) so that a change
    of the machine's load between steps falls on all modes alike; per mode: wall and step-thread CPU
    time of each `execute`, and the mask's own cost per row wherever it ran."""
    from chatserve.core.outputs import SchedulerOutput, ScheduledSeq
    from chatserve.core.request import SamplingParams

    masks = runner.sampler._grammar_masks()
    inner = masks._row_masks
    fill_s: dict[str, list[float]] = {m: [] for m in MODES}
    now = [MODES[0]]

    def timed(seqs: Any, v: int) -> Any:       # the mask's own cost, on whichever thread computes it
        t = time.perf_counter()
        out = inner(seqs, v)
        fill_s[now[0]].append((time.perf_counter() - t) / max(1, len(seqs)))
        return out

    masks._row_masks = timed
    per_row = blocks_per_row(runner, len(prompt), steps)
    rows = {m: _Rows(b, prompt, k * b * per_row, per_row, m, spec, SamplingParams, ScheduledSeq)
            for k, m in enumerate(MODES)}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for i in range(steps + 1):
            for m in MODES:
                now[0] = m
                masks.overlap = m == "overlap"
                out = SchedulerOutput(step_id=i, seqs=rows[m].step(prefill=i == 0), finished_ids=rows[m].finished)
                rows[m].finished = []
                t, c = time.perf_counter(), time.thread_time()
                res = runner.execute(out)
                if i:                                   # step 0 is the prefill
                    wall[m].append(time.perf_counter() - t)
                    cpu[m].append(time.thread_time() - c)
                if res.errors:
                    raise RuntimeError(f"step failed: {res.errors}")
                rows[m].feed(res.sampled, eos)
    finally:
        del masks._row_masks
        masks.overlap = None
        done = [r.rid(k) for r in rows.values() for k in range(b)]
        runner.execute(SchedulerOutput(step_id=-1, seqs=[], finished_ids=done))
    return {m: {"step_ms_p50": statistics.median(wall[m]) * 1e3, "step_ms_mean": statistics.fmean(wall[m]) * 1e3,
                "step_cpu_ms_mean": statistics.fmean(cpu[m]) * 1e3,
                "mask_us_per_token_p50": statistics.median(fill_s[m]) * 1e6 if fill_s[m] else None,
                "mask_us_per_token_mean": statistics.fmean(fill_s[m]) * 1e6 if fill_s[m] else None,
                "replies": len(rows[m].replies), "tokens": [t[len(prompt):] for t in rows[m].tokens],
                "texts": list(rows[m].replies.values())} for m in MODES}


def compile_ms(tok: Any, vocab_size: int, schema: dict, repeats: int = 5) -> dict[str, float]:
    """Median ms to compile the schema (fresh, no cache) and to compute the first mask of a fresh matcher."""
    import torch

    from chatserve.structured.compiler import GrammarCompiler
    from chatserve.structured.response_format import response_format_spec

    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    comp, first = [], []
    words = (vocab_size + 31) // 32
    for _ in range(repeats):
        c = GrammarCompiler(tok, vocab_size)
        c.ll_tokenizer                               # the tokenizer table is built once per process
        t = time.perf_counter()
        fmt = response_format_spec(rf)
        assert fmt is not None
        spec = c.compile(fmt)
        comp.append(time.perf_counter() - t)
        m = spec.compiled.template.deep_copy()
        buf = torch.zeros(words, dtype=torch.int32)
        t = time.perf_counter()
        m.unsafe_compute_mask_ptr(buf.data_ptr(), words * 4)
        first.append(time.perf_counter() - t)
    return {"compile_ms": statistics.median(comp) * 1e3, "first_mask_ms": statistics.median(first) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chatserve.bench.grammar_steps", description=__doc__)
    p.add_argument("--batch", default="1,16", help="rows per step, a list")
    p.add_argument("--steps", type=int, default=64, help="decode steps per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="times the three modes are alternated")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the server's auto)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    from chatserve.bench.workloads import STRUCTURED_SCHEMA
    from chatserve.config import CacheConfig, ModelConfig
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.structured.compiler import GrammarCompiler
    from chatserve.structured.response_format import response_format_spec
    from chatserve.text import Tokenizer

    batches = [int(x) for x in args.batch.split(",")]
    tok = Tokenizer.from_model(ModelConfig().resolved_model())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Review the film Alien (1979) as a JSON record."}])
    blocks = len(MODES) * max(batches) * -(-(len(prompt) + args.steps + 1) // CacheConfig().block_size)
    runner = ModelRunner(ModelConfig(num_threads=args.num_threads), CacheConfig(num_blocks=blocks), progress=False)
    runner.warm_up()
    eos = set(tok.eos_token_ids)
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": STRUCTURED_SCHEMA, "strict": True}}
    fmt = response_format_spec(rf)
    assert fmt is not None                                # a json_schema format always makes a spec
    spec = GrammarCompiler(tok, runner.vocab_size).compile(fmt)
    res: dict[str, Any] = {"compile": compile_ms(tok, runner.vocab_size, STRUCTURED_SCHEMA), "batches": {}}
    print(f"compile: {res['compile']}", file=sys.stderr, flush=True)
    for b in batches:
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for m, r in measure(runner, spec, prompt, b, args.steps, eos).items():
                runs[m].append(r)
                print(f"batch {b} {m}: mean step {r['step_ms_mean']:.2f} ms, step-thread CPU "
                      f"{r['step_cpu_ms_mean']:.2f} ms", file=sys.stderr, flush=True)
        same = all(a["tokens"] == o["tokens"] for a, o in zip(runs["inline"], runs["overlap"]))
        valid = [_parses(tok, t) for m in ("inline", "overlap") for r in runs[m] for t in r["texts"]]
        row: dict[str, Any] = {"identical_tokens": same, "replies_parsed": f"{sum(valid)}/{len(valid)}"}
        for m in MODES:
            row[m] = {k: statistics.median(r[k] for r in runs[m]) if runs[m][0][k] is not None else None
                      for k in ("step_ms_p50", "step_ms_mean", "step_cpu_ms_mean", "mask_us_per_token_p50",
                                "mask_us_per_token_mean")}
        for key in ("step_ms_mean", "step_cpu_ms_mean"):
            row[f"schema_vs_plain_{key}"] = row["inline"][key] / row["plain"][key]
            row[f"overlap_vs_plain_{key}"] = row["overlap"][key] / row["plain"][key]
        res["batches"][b] = row
    res["torch_threads_decode"] = torch.get_num_threads()
    print(json.dumps(res, indent=2) if args.json else _report(res))
    return 0 if all(r["identical_tokens"] for r in res["batches"].values()) else 1


def _parses(tok: Any, ids: list[int]) -> bool:
    try:
        json.loads(tok.decode([t for t in ids if t not in tok.eos_token_ids]))
        return True
    except ValueError:
        return False


def _report(res: dict[str, Any]) -> str:
    c = res["compile"]
    lines = [f"schema compile {c['compile_ms']:.2f} ms, first mask {c['first_mask_ms']:.2f} ms (median of 5)"]
    for b, row in res["batches"].items():
        lines.append(f"batch {b}: tokens identical inline/overlap: {row['identical_tokens']}, "
                     f"finished replies that parse: {row['replies_parsed']}")
        for m in MODES:
            r = row[m]
            mask = "" if r["mask_us_per_token_mean"] is None else (
                f"  mask/token p50 {r['mask_us_per_token_p50']:.0f} µs mean {r['mask_us_per_token_mean']:.0f} µs")
            lines.append(f"  {m:8s} step p50 {r['step_ms_p50']:7.2f} ms  mean {r['step_ms_mean']:7.2f} ms  "
                         f"step-thread CPU {r['step_cpu_ms_mean']:7.2f} ms{mask}")
        for key, what in (("step_ms_mean", "mean step"), ("step_cpu_ms_mean", "step-thread CPU")):
            lines.append(f"  schema/plain ({what}) inline {row['schema_vs_plain_' + key]:.3f}, "
                         f"overlap {row['overlap_vs_plain_' + key]:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
