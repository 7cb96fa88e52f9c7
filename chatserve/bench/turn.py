"""`chatserve bench turn`: where the time of a cached-prefix chat turn goes (issue 33).

A chat turn whose prefix is in the prefix cache runs only its new suffix: one prefill chunk of n prompt
rows at positions `--context`.. over the cached keys. This benchmark prefills `--context` tokens once
(untimed), then times, round after round, one such step for each `--new` size and one decode step at
the same context (the ratio the issue's goal is stated in), in an interleaved order so that a busy box
slows every row alike. Each step's wall time and process CPU time are taken, and the same steps are
split by op class: the Python entry points of the big items (`Linear._dense` and, in place,
`BlockLinear.__call__`, the attention backend's `attend` and `store`, `cpu_ops.*`, `compute_logits`) are
wrapped in counters (outermost call only); "rest" is what is left of the step (Python, metadata, aten
glue, embedding). The C decode chain of a decode step is not split (it is one call). Medians over
`--rounds` after one warm-up round.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

CLASSES = ("attention", "linears", "silu_mul", "norm", "kv_store", "rope", "lm_head")


class Counters:
    """Wall and process-CPU seconds per op class, counting only the outermost wrapped call."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        self.cpu: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        self.depth = 0

    def reset(self) -> None:
        for k in CLASSES:
            self.wall[k] = self.cpu[k] = 0.0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            if self.depth:
                return fn(*a, **kw)
            self.depth += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.wall[name] += time.perf_counter() - t0
                self.cpu[name] += time.process_time() - c0
                self.depth -= 1
        return timed


@contextlib.contextmanager
def instrumented(runner: Any, counters: Counters) -> Iterator[None]:
    """Wrap the op classes' entry points in `counters` for the duration (restored after)."""
    from chatserve.runtime.models import layers, linear_backends
    from chatserve_kernels import attention_backend, cpu_ops

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, name: str) -> None:
        old = getattr(owner, attr)
        patches.append((owner, attr, old))
        setattr(owner, attr, counters.wrap(name, old))

    patch(layers.Linear, "_dense", "linears")
    patch(linear_backends.BlockLinear, "__call__", "linears")      # --gguf-in-place matrices
    for cls in (attention_backend.TorchAttention, attention_backend.CpuAttention):
        if "attend" in vars(cls):
            patch(cls, "attend", "attention")
        if "store" in vars(cls):
            patch(cls, "store", "kv_store")
    patch(cpu_ops, "silu_mul", "silu_mul")
    patch(cpu_ops, "add_rms_norm", "norm")
    patch(cpu_ops, "rope_", "rope")
    patch(runner.model, "compute_logits", "lm_head")
    try:
        yield
    finally:
        for owner, attr, old in reversed(patches):
            if owner is runner.model:
                delattr(owner, attr)            # back to the class's method
            else:
                setattr(owner, attr, old)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench turn", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M Q4_1)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weight-quant", default="auto")
    p.add_argument("--gguf-in-place", action="store_true",
                   help="keep the GGUF's matrices in their block format (as serve's --gguf-in-place)")
    p.add_argument("--context", type=int, default=1024, help="cached tokens before the turn")
    p.add_argument("--new", default="16,32,64", help="new tokens of a turn (comma list)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every step once)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-split", action="store_true", help="time whole steps only (no op counters)")
    p.add_argument("--json", action="store_true")
    return p


def measure(args: argparse.Namespace) -> dict:
    from chatserve.config import CacheConfig, ModelConfig
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
    from chatserve.core.request import SamplingParams
    from chatserve.runtime.device import set_num_threads
    from chatserve.runtime.model_runner import ModelRunner

    threads = set_num_threads(args.threads)
    news = [int(x) for x in str(args.new).split(",") if x]
    bs = 16
    blocks = -(-(args.context + max(news) + 2) // bs)
    config = ModelConfig(model=args.model, dtype=args.dtype, weight_quant=args.weight_quant,
                         gguf_in_place=args.gguf_in_place, num_threads=threads)
    runner = ModelRunner(config, CacheConfig(block_size=bs, num_blocks=blocks), progress=False)
    params = SamplingParams(temperature=0.0)
    table = list(range(blocks))
    ctx = [(17 * i + 5) % runner.vocab_size for i in range(args.context)]
    turn = [(31 * i + 7) % runner.vocab_size for i in range(max(news))]
    step = 0
    for s in range(0, args.context, 512):                       # the cached prefix, untimed
        step += 1
        chunk = ctx[s:s + 512]
        runner.execute(SchedulerOutput(step, [ScheduledSeq("t", chunk, s, table, s + len(chunk) == args.context,
                                                           params, ctx)]))
    counters = Counters()
    kinds = ["decode"] + [f"new{n}" for n in news]
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}

    def run_step(kind: str) -> None:
        nonlocal step
        step += 1
        toks = [ctx[-1]] if kind == "decode" else turn[:int(kind[3:])]
        full = ctx if kind == "decode" else ctx + toks          # decode: a generated row (the decode path)
        counters.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(SchedulerOutput(step, [ScheduledSeq("t", toks, args.context, table, True, params, full)]))
        r = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
        for k in CLASSES:
            r[f"{k}_wall"], r[f"{k}_cpu"] = counters.wall[k], counters.cpu[k]
        rows[kind].append(r)

    with contextlib.nullcontext() if args.no_split else instrumented(runner, counters):
        for rnd in range(args.rounds + 1):
            for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                run_step(kind)
    out: dict[str, Any] = {"context": args.context, "threads": threads, "rounds": args.rounds,
                           "dtype": str(runner.dtype).replace("torch.", ""), "weight_quant": runner.weight_quant,
                           "gguf_in_place": args.gguf_in_place,
                           "load_before": os.getloadavg(), "steps": {}}
    for kind, xs in rows.items():
        xs = xs[1:]                                               # the warm-up round
        med = {key: statistics.median(x[key] for x in xs) * 1e3 for key in xs[0]}
        for t in ("wall", "cpu"):
            med[f"rest_{t}"] = med[t] - sum(med[f"{k}_{t}"] for k in CLASSES)
        out["steps"][kind] = med
    dec = out["steps"]["decode"]
    for med in out["steps"].values():
        med["per_decode_wall"] = med["wall"] / dec["wall"]
        med["per_decode_cpu"] = med["cpu"] / dec["cpu"]
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    r = measure(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"cached-prefix turn over {r['context']} tokens: {r['dtype']}, weight quant {r['weight_quant']}, "
          f"{r['threads']} threads, median of {r['rounds']} rounds; ms per step, wall / process CPU")
    cols = ("total",) + CLASSES + ("rest",)
    print(f"{'step':8s}" + "".join(f"{c:>16s}" for c in cols) + f"{'÷ decode':>12s}")
    for kind, m in r["steps"].items():
        cells = [(m["wall"], m["cpu"])] + [(m[f"{c}_wall"], m[f"{c}_cpu"]) for c in cols[1:]]
        print(f"{kind:8s}" + "".join(f"{w:8.1f}/{c:7.1f}" for w, c in cells)
              + f"{m['per_decode_wall']:6.2f}/{m['per_decode_cpu']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
