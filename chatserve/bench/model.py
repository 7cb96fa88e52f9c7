"""`chatserve bench model`: decode tokens/s at several batch sizes and prefill tokens/s for a model
on this machine, per dtype, measured through ModelRunner.execute (metadata, forward, logits, sampling).

Not a serving benchmark (no scheduler, HTTP or detokenizer: see `bench scheduler` and `bench serve`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Any


def _parse_list(s: str, cast=str) -> list:
    return [cast(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench model", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M Q4_1)")
    p.add_argument("--shape", default=None,
                   help="instead of --model: a random-weight checkpoint of this shape (llama-3.2-1b), "
                        "built into the chatserve cache on first use (`chatserve bench build-model`)")
    p.add_argument("--bandwidth-mib", type=int, default=2048,
                   help="size of the buffer whose sum measures the memory read bandwidth, for the "
                        "floor beside the batch-1 step (0: skip)")
    p.add_argument("--dtypes", default="float32+int4,bfloat16+int4",
                   help="comma list of auto | float32 | bfloat16 | float16, each optionally +int8, "
                        "+int4 or +auto (weight-only quantized matmuls for steps of few rows), or "
                        "+inplace[-avx2|-avx512|-torch] (a GGUF's own blocks through the block kernels)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence before decoding")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--prefill-tokens", default="512",
                   help="comma list: prompt lengths of the timed prefills, each measured in this run "
                        "(e.g. 512,4000,8000: tokens/s nearly flat in the length is the goal)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill in steps of this many tokens over the growing cached prefix, as the "
                        "server's chunked prefill does (0: the whole prompt in one step)")
    p.add_argument("--repeats", type=int, default=3, help="prefill repeats (median reported)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--interference", default="",
                   help="comma list of prefill caps: for each, 4 streams decode (over --context tokens) "
                        "while a --interference-prompt-token prompt is chunk-prefilled beside them in "
                        "steps of that many tokens (the scheduler's --prefill-tokens-while-decoding; "
                        "508 = a 512 budget less the 4 decoders); reports their inter-token latency "
                        "p50/p99 with and without the prompt, and the prompt's time to first token")
    p.add_argument("--interference-prompt", type=int, default=4000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--agreement", action="store_true",
                   help="instead of timings: greedy outputs of each --dtypes variant against fp32 dense "
                        "weights, over the 20 chat prompts of `bench kernels --quality`")
    p.add_argument("--max-tokens", type=int, default=32, help="for --agreement")
    p.add_argument("--moe-ab", type=int, default=0,
                   help="MoE models: for each batch, this many rounds of decode with cpu_moe's (in-place "
                        "GGUF experts: cpu_moe_block's) one call per "
                        "layer then with the expert loop (the same model, alternating), each reported")
    p.add_argument("--profile", type=int, default=0,
                   help="instead of timings: torch.profiler over this many batch-1 decode steps of the "
                        "first --dtypes variant; prints ops per step, op time against wall time, top ops")
    return p


def agreement(path: str, variants: list[str], max_tokens: int) -> dict:
    """Greedy continuations of each variant ("dtype[+quant]") vs float32 with dense weights."""
    from chatserve.bench.kernels import PROMPTS
    from chatserve.core.request import SamplingParams
    from chatserve.engine.llm import LLM
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.text import Tokenizer

    tok = Tokenizer.from_model(path)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    eos = sorted(set(tok.eos_token_ids))
    outs = {}
    for v in ["float32", *variants]:
        base, _, quant = v.partition("+")
        llm = LLM(path, dtype=base, weight_quant=quant or None, eos_token_ids=eos)
        runner = llm.runner
        assert isinstance(runner, ModelRunner)             # LLM built it from the path
        outs[v] = (str(runner.dtype).replace("torch.", ""), runner.weight_quant, llm.generate(ids, params))
    ref = outs["float32"][2]
    report: dict[str, Any] = {"prompts": len(ids), "max_tokens": max_tokens, "results": []}
    for v in variants:
        dt, wq, got = outs[v]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(ref, got)]
        report["results"].append({"variant": v, "dtype": dt, "weight_quant": wq,
                                  "identical": sum(a == b for a, b in zip(ref, got)),
                                  "mean_matching_prefix": sum(prefix) / len(prefix)})
    return report


def profile_decode(runner, context: int, steps: int, top: int = 25) -> dict:
    """One stream's decode steps under torch.profiler: aten ops per step, their self CPU time per step
    against the step's wall time (the rest is Python and dispatch), and the op table."""
    from torch.profiler import ProfilerActivity, profile

    _decode(runner, 1, context, 4)                                     # warm-up (and the prefill)
    prof = profile(activities=[ProfilerActivity.CPU])
    d = _decode(runner, 1, context, steps, warmup=0, timed=prof)
    ev = prof.key_averages()
    ops = [e for e in ev if e.key.startswith("aten::")]
    self_ms = sum(e.self_cpu_time_total for e in ev) / 1e3 / steps
    table = ev.table(sort_by="self_cpu_time_total", row_limit=top)
    return {"steps": steps, "wall_ms_per_step": d["step_ms_median"],
            "aten_ops_per_step": sum(e.count for e in ops) / steps,
            "top_level_calls_per_step": sum(e.count for e in ev) / steps,
            "op_self_ms_per_step": self_ms, "table": table}


def _decode(runner, batch: int, context: int, steps: int, warmup: int = 2, timed=None) -> dict:
    """`steps` decode steps of `batch` sequences after a `context`-token prefill each; timed: a
    context manager entered around the decode steps only (a profiler)."""
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
    from chatserve.core.request import SamplingParams

    bs = runner.block_size
    params = SamplingParams(temperature=0.0)
    per_seq = -(-(context + steps + 2) // bs)
    if per_seq * batch > runner.num_blocks:
        raise ValueError(f"batch {batch} x {context + steps} tokens needs {per_seq * batch} blocks")
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    prompt = [(17 * i + 5) % runner.vocab_size for i in range(context)]
    step = 0
    # prefill each sequence (untimed), in chunks the size a server would use
    for b in range(batch):
        for s in range(0, context, 512):
            step += 1
            chunk = prompt[s:s + 512]
            runner.execute(SchedulerOutput(step, [ScheduledSeq(
                f"s{b}", chunk, s, tables[b], s + len(chunk) == context, params, prompt)]))
    last = [prompt[-1]] * batch
    times: list[float] = []
    with timed or contextlib.nullcontext():
        _decode_steps(runner, batch, context, steps, warmup, step, tables, last, params, times, prompt)
    return _decode_result(batch, context, times)


def _decode_steps(runner, batch: int, context: int, steps: int, warmup: int, step: int,
                  tables: list[list[int]], last: list[int], params, times: list[float],
                  prompt: list[int]) -> None:
    """The decode loop of _decode: appends each step's seconds (after `warmup` steps) to `times`."""
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput

    for i in range(steps + warmup):
        pos = context + i
        out = SchedulerOutput(step + i + 1, [ScheduledSeq(f"s{b}", [last[b]], pos, tables[b], True, params,
                                                          prompt) for b in range(batch)])
        t0 = time.perf_counter()
        res = runner.execute(out)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        last = [res.sampled[f"s{b}"] for b in range(batch)]


def _decode_result(batch: int, context: int, times: list[float]) -> dict:
    med = statistics.median(times)
    return {"batch": batch, "context": context, "step_ms_median": med * 1e3,
            "step_ms_min": min(times) * 1e3, "tokens_per_s": batch / med,
            "tokens_per_s_best": batch / min(times)}


def read_bandwidth(mib: int, repeats: int = 5) -> float:
    """Bytes/s of a torch sum over a `mib`-MiB float32 buffer (far bigger than the last-level cache),
    best of `repeats`: what a memory-bound decode step can read at most."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    x.sum()                                                       # first touch, untimed
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux: KiB


def _prefill(runner, tokens: int, repeats: int, chunk: int = 0, warmup: bool = True) -> dict:
    """One prompt of `tokens` tokens, in one step or in steps of `chunk`; median of `repeats` after a
    warm-up (`warmup`: the shortest length's warms the kernels for the longer ones). peak_rss_mib: the
    process's peak resident memory after it (run lengths in rising order:
    the growth from one length to the next is what a longer prefill costs)."""
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
    from chatserve.core.request import SamplingParams

    bs = runner.block_size
    table = list(range(-(-tokens // bs)))
    prompt = [(31 * i + 7) % runner.vocab_size for i in range(tokens)]
    step = chunk if chunk > 0 else tokens
    params = SamplingParams(temperature=0.0)
    times = []
    n = 0
    for r in range(0 if warmup else 1, repeats + 1):
        t0 = time.perf_counter()
        for s in range(0, tokens, step):
            n += 1
            piece = prompt[s:s + step]
            runner.execute(SchedulerOutput(n, [ScheduledSeq("p", piece, s, table, s + len(piece) == tokens,
                                                            params, prompt)]))
        if r:                            # first run warms up
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"tokens": tokens, "chunk": step, "ms_median": med * 1e3, "tokens_per_s": tokens / med,
            "tokens_per_s_best": tokens / min(times), "peak_rss_mib": _peak_rss_mib()}


def _percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) of xs, linear between the closest ranks."""
    v = sorted(xs)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _interference(runner, cap: int, context: int, prompt_len: int, streams: int = 4,
                  alone_steps: int = 32) -> dict:
    """Inter-token latency (step time) of `streams` decoding sequences alone, then while a
    prompt_len-token prompt is chunk-prefilled beside them, `cap` prompt tokens per step; the prompt's
    TTFT is the sum of those steps (it samples in the last). The *_cpu_* figures are this process's CPU
    time per step: on a shared, oversubscribed box they stand for what an idle one would take (with one
    thread; with more they add the threads' times up)."""
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
    from chatserve.core.request import SamplingParams

    bs = runner.block_size
    params = SamplingParams(temperature=0.0)
    cap = max(1, cap)
    per = -(-(context + alone_steps + 2 + -(-prompt_len // cap) + 2) // bs)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(streams)]
    long_table = list(range(streams * per, streams * per + -(-prompt_len // bs)))
    ctx_prompt = [(17 * i + 5) % runner.vocab_size for i in range(context)]
    prompt = [(31 * i + 7) % runner.vocab_size for i in range(prompt_len)]
    step = 0
    for b in range(streams):                                    # the streams' prompts, untimed
        step += 1
        runner.execute(SchedulerOutput(step, [ScheduledSeq(f"s{b}", ctx_prompt, 0, tables[b], True, params,
                                                            ctx_prompt)]))
    pos, last = context, [ctx_prompt[-1]] * streams

    def decode_step(extra: list) -> tuple[float, float]:
        nonlocal step, pos, last
        step += 1
        seqs = [ScheduledSeq(f"s{b}", [last[b]], pos, tables[b], True, params, ctx_prompt)
                for b in range(streams)]
        t0, c0 = time.perf_counter(), time.process_time()
        res = runner.execute(SchedulerOutput(step, seqs + extra))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        pos += 1
        last = [res.sampled[f"s{b}"] for b in range(streams)]
        return dt, dc

    for _ in range(2):
        decode_step([])                                         # warm-up
    alone = [decode_step([]) for _ in range(alone_steps)]
    mixed = []
    for s in range(0, prompt_len, cap):
        piece = prompt[s:s + cap]
        mixed.append(decode_step([ScheduledSeq("long", piece, s, long_table, s + len(piece) == prompt_len,
                                               params, prompt)]))
    res: dict[str, Any] = {"cap": cap, "streams": streams, "context": context, "prompt": prompt_len,
                           "steps": len(mixed)}
    for i, kind in ((0, ""), (1, "cpu_")):
        a, m = [x[i] for x in alone], [x[i] for x in mixed]
        res.update({f"itl_alone_{kind}ms_p50": _percentile(a, 50) * 1e3,
                    f"itl_alone_{kind}ms_p99": _percentile(a, 99) * 1e3,
                    f"itl_mixed_{kind}ms_p50": _percentile(m, 50) * 1e3,
                    f"itl_mixed_{kind}ms_p99": _percentile(m, 99) * 1e3,
                    f"itl_{kind}p99_ratio": _percentile(m, 99) / max(_percentile(a, 99), 1e-9),
                    f"prompt_ttft_{kind}s": sum(m)})
    return res


def run(args: argparse.Namespace) -> dict:
    import torch

    from chatserve.runtime.device import set_num_threads
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.runtime.weights import load_weights

    threads = set_num_threads(args.threads)
    path = _model_path(args)
    batches = _parse_list(args.batches, int)
    t0 = time.perf_counter()
    # a shaped checkpoint is bf16 on disk: read as such (exact), each variant converts its own copy
    in_place_only = all("+inplace" in v for v in _parse_list(args.dtypes))    # they map the file themselves
    weights = None if in_place_only else load_weights(path, "bfloat16" if args.shape else "float32",
                                                      progress=not args.json)
    load_s = time.perf_counter() - t0
    prefill_lengths = sorted(_parse_list(args.prefill_tokens, int))
    need = max(max(batches) * -(-(args.context + args.steps + 2) // args.block_size),
               -(-max(prefill_lengths, default=0) // args.block_size))
    caps = _parse_list(args.interference, int)
    for cap in caps:
        per = -(-(args.context + 36 + -(-args.interference_prompt // max(1, cap))) // args.block_size)
        need = max(need, 4 * per - (-args.interference_prompt // args.block_size))
    report: dict = {"model": os.path.basename(path), "threads": threads, "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(), "load_s": load_s, "results": []}
    bandwidth = read_bandwidth(args.bandwidth_mib) if args.bandwidth_mib > 0 else None
    report["read_bandwidth_gb_s"] = bandwidth / 1e9 if bandwidth else None
    if bandwidth and not args.json:
        print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over {args.bandwidth_mib} MiB, best of 5)",
              file=sys.stderr, flush=True)
    for dtype in _parse_list(args.dtypes):
        base, _, quant = dtype.partition("+")
        if quant.startswith("inplace"):       # +inplace[-avx2|-avx512|-torch]: GGUF blocks, read in place
            runner = _in_place_runner(path, base, quant.partition("-")[2] or "auto", args, need, threads)
            if not args.json:
                print(f"{dtype}: loaded in place in {runner.load_seconds:.1f} s, peak RSS "
                      f"{_peak_rss_mib():.0f} MiB", file=sys.stderr, flush=True)
        else:
            runner = ModelRunner.from_config(offline_config(
                path, dtype=base, device=args.device, block_size=args.block_size, num_blocks=need,
                num_threads=threads, weight_quant=quant or None), weights=weights)
        report["results"].append(_bench_dtype(runner, dtype, args, batches, prefill_lengths, caps, bandwidth))
        del runner
    return report


def _in_place_runner(path: str, dtype: str, isa: str, args: argparse.Namespace, blocks: int, threads: int):
    """A runner on the GGUF's own blocks (--gguf-in-place) with the block kernels at level `isa`."""
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner

    return ModelRunner.from_config(offline_config(
        path, dtype=dtype, device=args.device, num_threads=threads, weight_quant=None, gguf_in_place=True,
        cpu_isa=isa, block_size=args.block_size, num_blocks=blocks))


def _bench_dtype(runner, dtype: str, args: argparse.Namespace, batches: list[int], prefill_lengths: list[int],
                 caps: list[int], bandwidth: float | None) -> dict:
    """One --dtypes entry on its runner: decode per batch size, prefill per length, interference per cap."""
    entry: dict = {"dtype": dtype, "resolved_dtype": str(runner.dtype).replace("torch.", ""),
                   "weight_quant": runner.weight_quant, "decode": [], "prefill": []}
    for b, label in _decode_plan(runner, batches, args.moe_ab):
        d = _decode(runner, b, args.context, args.steps)
        if label:
            d["moe"] = label
        if bandwidth:
            d["weight_bytes_per_step"] = runner.model.decode_weight_bytes(b)
            d["floor_ms"] = d["weight_bytes_per_step"] / bandwidth * 1e3
            d["vs_floor"] = d["step_ms_median"] / d["floor_ms"]
        entry["decode"].append(d)
        if not args.json:
            floor = (f"; floor {d['floor_ms']:.1f} ms = {d['weight_bytes_per_step'] / 1e6:.0f} MB of weights "
                     f"/ bandwidth, step {d['vs_floor']:.2f}x it" if bandwidth else "")
            print(f"{dtype:12s}{' ' + label if label else ''} decode batch {b:3d}: {d['tokens_per_s']:8.1f} tok/s "
                  f"(step {d['step_ms_median']:.1f} ms median, best {d['tokens_per_s_best']:.1f} tok/s{floor})",
                  file=sys.stderr, flush=True)
    rss0 = _peak_rss_mib()
    for n in prefill_lengths:
        p = _prefill(runner, n, args.repeats, args.prefill_chunk, warmup=not entry["prefill"])
        p["vs_shortest"] = p["tokens_per_s"] / (entry["prefill"][0] if entry["prefill"] else p)["tokens_per_s"]
        p["peak_rss_growth_mib"] = p["peak_rss_mib"] - rss0
        entry["prefill"].append(p)
        if not args.json:
            print(f"{dtype:12s} prefill {n} tokens (steps of {p['chunk']}): {p['tokens_per_s']:8.1f} tok/s "
                  f"({p['ms_median']:.0f} ms, {p['vs_shortest']:.2f}x the shortest's tok/s, peak RSS "
                  f"+{p['peak_rss_growth_mib']:.0f} MiB)", file=sys.stderr, flush=True)
    entry["interference"] = []
    for cap in caps:
        it = _interference(runner, cap, args.context, args.interference_prompt)
        entry["interference"].append(it)
        if not args.json:
            print(f"{dtype:12s} cap {cap}: 4 streams' ITL p50/p99 {it['itl_alone_ms_p50']:.1f}/"
                  f"{it['itl_alone_ms_p99']:.1f} ms alone, {it['itl_mixed_ms_p50']:.1f}/"
                  f"{it['itl_mixed_ms_p99']:.1f} ms beside a {it['prompt']}-token prefill (p99 "
                  f"{it['itl_p99_ratio']:.2f}x); the prompt's TTFT {it['prompt_ttft_s']:.2f} s in "
                  f"{it['steps']} steps; CPU time: ITL p50/p99 {it['itl_alone_cpu_ms_p50']:.1f}/"
                  f"{it['itl_alone_cpu_ms_p99']:.1f} alone, {it['itl_mixed_cpu_ms_p50']:.1f}/"
                  f"{it['itl_mixed_cpu_ms_p99']:.1f} beside it (p99 {it['itl_cpu_p99_ratio']:.2f}x), "
                  f"TTFT {it['prompt_ttft_cpu_s']:.2f} s", file=sys.stderr, flush=True)
    return entry


def _decode_plan(runner, batches: list[int], ab_rounds: int):
    """(batch, label) per decode measurement; with ab_rounds, per batch `ab_rounds` rounds of the MoE layers
    with cpu_moe's one call ("moe-c") and without it ("moe-loop"), in alternating order, switched on the
    loaded model between runs."""
    if not ab_rounds:
        yield from ((b, "") for b in batches)
        return
    moes = [ly.mlp for ly in runner.model.layers if getattr(ly.mlp, "packed", None) is not None]
    if not moes:
        raise SystemExit("--moe-ab: no MoE layer of this model runs cpu_moe or cpu_moe_block (not a MoE model, "
                         "no int4/int8 cpu_qmatmul experts nor in-place block experts with integer codes, or "
                         "CHATSERVE_MOE_KERNEL=0)")
    packed = [m.packed for m in moes]
    for b in batches:
        for r in range(ab_rounds):                       # A B, B A, …: neither variant always runs first
            for label in ("moe-c", "moe-loop")[::1 if r % 2 == 0 else -1]:
                for m, pk in zip(moes, packed):
                    m.packed = pk if label == "moe-c" else None
                yield b, label
    for m, pk in zip(moes, packed):
        m.packed = pk


def _model_path(args: argparse.Namespace) -> str:
    if args.shape:
        from chatserve.bench.checkpoint import build_checkpoint, default_dir

        if args.model:
            raise SystemExit("chatserve bench model: give --model or --shape, not both")
        return str(build_checkpoint(default_dir(args.shape), args.shape, progress=not args.json))
    from chatserve.config import ModelConfig

    return ModelConfig(model=args.model).resolved_model()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.agreement:
        rep = agreement(_model_path(args), _parse_list(args.dtypes), args.max_tokens)
        if args.json:
            print(json.dumps(rep, indent=2))
        else:
            for r in rep["results"]:
                print(f"{r['variant']:16s} ({r['dtype']}, {r['weight_quant'] or 'dense'}): {r['identical']}/"
                      f"{rep['prompts']} greedy outputs identical to float32 dense, mean matching prefix "
                      f"{r['mean_matching_prefix']:.1f} of {rep['max_tokens']} tokens")
        return 0
    if args.profile:
        return _profile_main(args)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"model {report['model']}, {report['threads']} threads, torch {report['torch']}, "
              f"weights read in {report['load_s']:.1f} s")
        print(f"{'dtype':14s}{'batch':>6s}{'tok/s':>10s}{'step ms':>10s}")
        for e in report["results"]:
            for d in e["decode"]:
                floor = f"  (floor {d['floor_ms']:.1f} ms, {d['vs_floor']:.2f}x)" if "floor_ms" in d else ""
                name = e["dtype"] + (" " + d["moe"] if "moe" in d else "")
                print(f"{name:14s}{d['batch']:6d}{d['tokens_per_s']:10.1f}{d['step_ms_median']:10.1f}{floor}")
            for p in e["prefill"]:
                print(f"{e['dtype']:14s}{'pf' + str(p['tokens']):>6s}{p['tokens_per_s']:10.1f}{p['ms_median']:10.1f}"
                      f"  ({p['vs_shortest']:.2f}x, peak RSS +{p['peak_rss_growth_mib']:.0f} MiB)")
    return 0


def _profile_main(args: argparse.Namespace) -> int:
    from chatserve.runtime.device import set_num_threads
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner

    threads = set_num_threads(args.threads)
    base, _, quant = _parse_list(args.dtypes)[0].partition("+")
    runner = ModelRunner.from_config(offline_config(
        _model_path(args), dtype=base, device=args.device, block_size=args.block_size,
        num_blocks=-(-(args.context + args.profile + 16) // args.block_size) * 2, num_threads=threads,
        weight_quant=quant or None))
    p = profile_decode(runner, args.context, args.profile)
    if args.json:
        print(json.dumps({k: v for k, v in p.items()}, indent=2))
        return 0
    print(p["table"])
    print(f"{runner.config.num_layers} layers, {base}+{quant or 'dense'}: {p['aten_ops_per_step']:.0f} aten ops "
          f"({p['top_level_calls_per_step']:.0f} profiled calls) per step; op self time "
          f"{p['op_self_ms_per_step']:.2f} ms of {p['wall_ms_per_step']:.2f} ms wall (median step)")
    return 0
