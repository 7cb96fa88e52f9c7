"""Decode steps of the default model with and without a JSON schema, the mask inline or during the forward.

`python -m chatserve.bench.grammar_steps` drives ModelRunner directly (no server): B rows decode side by
side at temperature 1 with per-row seeds, in three modes alternated in one run (plain, schema with the mask
on the step thread, schema with the mask prefetched during the forward); prints ms per step, the mask's
cost per token, grammar compile time, and checks that both schema modes sample the same tokens.
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

    def __init__(self, b: int, prompt: list[int], blocks_per_row: int, mode: str, spec: Any, params_cls: Any,
                 seq_cls: Any) -> None:
        self.mode, self.spec, self.P, self.S = mode, spec, params_cls, seq_cls
        self.tokens = [list(prompt) for _ in range(b)]          # prompt + every sampled token, per row
        self.reply_start = [len(prompt)] * b
        self.reply_no = [0] * b
        self.tables = [list(range(r * blocks_per_row, (r + 1) * blocks_per_row)) for r in range(b)]
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


def measure(runner: Any, spec: Any, prompt: list[int], b: int, steps: int, mode: str, eos: set[int]
            ) -> dict[str, Any]:
    from chatserve.core.outputs import SchedulerOutput, ScheduledSeq
    from chatserve.core.request import SamplingParams

    masks = runner.sampler._grammar_masks()
    masks.overlap = mode == "overlap"
    fill_s: list[float] = []
    inner = masks._forbidden

    def timed(seqs: Any, v: int) -> Any:       # the mask's own cost, on whichever thread computes it
        t = time.perf_counter()
        out = inner(seqs, v)
        fill_s.append((time.perf_counter() - t) / max(1, len(seqs)))
        return out

    masks._forbidden = timed
    rows = _Rows(b, prompt, -(-(len(prompt) + steps + 1) // runner.block_size), mode, spec, SamplingParams,
                 ScheduledSeq)
    step_s: list[float] = []
    try:
        for i in range(steps + 1):
            out = SchedulerOutput(step_id=i, seqs=rows.step(prefill=i == 0), finished_ids=rows.finished)
            rows.finished = []
            t = time.perf_counter()
            res = runner.execute(out)
            if i:                                   # step 0 is the prefill
                step_s.append(time.perf_counter() - t)
            if res.errors:
                raise RuntimeError(f"step failed: {res.errors}")
            rows.feed(res.sampled, eos)
    finally:
        del masks._forbidden
        masks.overlap = None
        runner.execute(SchedulerOutput(step_id=-1, seqs=[], finished_ids=[rows.rid(r) for r in range(b)]))
    return {"step_ms_p50": statistics.median(step_s) * 1e3, "step_ms_mean": statistics.fmean(step_s) * 1e3,
            "mask_us_per_token_p50": statistics.median(fill_s) * 1e6 if fill_s else None,
            "mask_us_per_token_mean": statistics.fmean(fill_s) * 1e6 if fill_s else None,
            "replies": len(rows.replies), "tokens": [t[len(prompt):] for t in rows.tokens],
            "texts": list(rows.replies.values())}


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
        spec = c.compile(response_format_spec(rf))
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
    blocks = max(batches) * -(-(64 + args.steps + 1) // 16)
    runner = ModelRunner(ModelConfig(num_threads=args.num_threads), CacheConfig(num_blocks=blocks), progress=False)
    runner.warm_up()
    tok = Tokenizer.from_model(runner.model_path)
    eos = set(tok.eos_token_ids)
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": STRUCTURED_SCHEMA, "strict": True}}
    spec = GrammarCompiler(tok, runner.vocab_size).compile(response_format_spec(rf))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Review the film Alien (1979) as a JSON record."}])
    res: dict[str, Any] = {"compile": compile_ms(tok, runner.vocab_size, STRUCTURED_SCHEMA), "batches": {}}
    print(f"compile: {res['compile']}", file=sys.stderr, flush=True)
    for b in batches:
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for m in MODES:
                runs[m].append(measure(runner, spec, prompt, b, args.steps, m, eos))
                print(f"batch {b} {m}: mean step {runs[m][-1]['step_ms_mean']:.2f} ms", file=sys.stderr, flush=True)
        same = all(a["tokens"] == o["tokens"] for a, o in zip(runs["inline"], runs["overlap"]))
        valid = [_parses(tok, t) for m in ("inline", "overlap") for r in runs[m] for t in r["texts"]]
        row: dict[str, Any] = {"identical_tokens": same, "replies_parsed": f"{sum(valid)}/{len(valid)}"}
        for m in MODES:
            row[m] = {k: statistics.median(r[k] for r in runs[m]) if runs[m][0][k] is not None else None
                      for k in ("step_ms_p50", "step_ms_mean", "mask_us_per_token_p50", "mask_us_per_token_mean")}
        row["schema_vs_plain"] = row["inline"]["step_ms_mean"] / row["plain"]["step_ms_mean"]
        row["overlap_vs_plain"] = row["overlap"]["step_ms_mean"] / row["plain"]["step_ms_mean"]
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
            lines.append(f"  {m:8s} step p50 {r['step_ms_p50']:7.2f} ms  mean {r['step_ms_mean']:7.2f} ms{mask}")
        lines.append(f"  schema/plain (mean step) inline {row['schema_vs_plain']:.3f}, "
                     f"overlap {row['overlap_vs_plain']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
