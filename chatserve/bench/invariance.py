"""`chatserve bench invariance`: what batch invariance (--batch-invariant, the default) costs a step.

Invariance changes one thing: in a step that mixes a prompt chunk with decode rows, the decode rows take
the quantized matmuls and the prompt rows the dense ones (two weight copies read), where
--no-batch-invariant sends every row of a large step through the dense weight. Steps of one kind run the
same kernels either way. This benchmark runs both kinds of step on one runner, switching the mode step by
step (so a busy machine slows both modes alike), and reports each mode's median wall and CPU time per
step, and the serving cost that follows for a workload with one prompt chunk per `--decode-steps-per-prompt`
decode steps (c16 256/128: 16 streams, a 256-token prompt every 128 / 16 = 8 decode steps).
`chatserve bench serve` against a server started with and without --no-batch-invariant measures the
same thing end to end (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench invariance", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M Q4_1)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weight-quant", default="auto")
    p.add_argument("--streams", type=int, default=16, help="decoding sequences in every step")
    p.add_argument("--context", type=int, default=256, help="their tokens before the timed steps")
    p.add_argument("--prompt", type=int, default=256, help="prompt chunk tokens of a mixed step")
    p.add_argument("--rounds", type=int, default=12, help="timed steps of each kind and mode")
    p.add_argument("--decode-steps-per-prompt", type=float, default=8.0,
                   help="for the serving estimate: decode-only steps per mixed step")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    return p


def measure(args: argparse.Namespace) -> dict:
    from chatserve.config import CacheConfig, ModelConfig
    from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
    from chatserve.core.request import SamplingParams
    from chatserve.runtime.device import set_num_threads
    from chatserve.runtime.model_runner import ModelRunner

    threads = set_num_threads(args.threads)
    bs = 16
    steps = 2 * 2 * (args.rounds + 1)                      # decode + mixed, both modes, and a warm-up round
    per = -(-(args.context + steps + 2) // bs)
    blocks = args.streams * per + -(-args.prompt // bs)
    runner = ModelRunner(ModelConfig(model=args.model, dtype=args.dtype, weight_quant=args.weight_quant,
                                     num_threads=threads), CacheConfig(block_size=bs, num_blocks=blocks),
                         progress=False)
    params = SamplingParams(temperature=0.0)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(args.streams)]
    long_table = list(range(args.streams * per, blocks))
    ctx = [(17 * i + 5) % runner.vocab_size for i in range(args.context)]
    prompt = [(31 * i + 7) % runner.vocab_size for i in range(args.prompt)]
    step = 0
    for b in range(args.streams):                          # the streams' prompts, untimed
        step += 1
        runner.execute(SchedulerOutput(step, [ScheduledSeq(f"s{b}", ctx, 0, tables[b], True, params, ctx)]))
    pos, last = args.context, [ctx[-1]] * args.streams
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}

    def run_step(kind: str, invariant: bool) -> None:
        nonlocal step, pos, last
        step += 1
        runner.batch_invariant = invariant
        seqs = [ScheduledSeq(f"s{b}", [last[b]], pos, tables[b], True, params, ctx) for b in range(args.streams)]
        if kind == "mixed":                                # the same chunk again: same work every time
            seqs.append(ScheduledSeq("long", prompt, 0, long_table, False, params, prompt))
        t0, c0 = time.perf_counter(), time.process_time()
        res = runner.execute(SchedulerOutput(step, seqs))
        times.setdefault((kind, invariant), []).append((time.perf_counter() - t0, time.process_time() - c0))
        pos += 1
        last = [res.sampled[f"s{b}"] for b in range(args.streams)]

    for r in range(args.rounds + 1):
        order = (True, False) if r % 2 else (False, True)   # alternate which mode goes first
        for invariant in order:
            for kind in ("decode", "mixed"):
                run_step(kind, invariant)
    runner.batch_invariant = True
    out: dict = {"streams": args.streams, "context": args.context, "prompt": args.prompt, "rounds": args.rounds,
                 "threads": threads, "dtype": str(runner.dtype).replace("torch.", ""),
                 "weight_quant": runner.weight_quant}
    for (kind, invariant), xs in times.items():
        xs = xs[1:]                                        # the warm-up round
        mode = "on" if invariant else "off"
        out[f"{kind}_{mode}_ms"] = statistics.median(x[0] for x in xs) * 1e3
        out[f"{kind}_{mode}_cpu_ms"] = statistics.median(x[1] for x in xs) * 1e3
    k = args.decode_steps_per_prompt
    for t in ("", "cpu_"):
        off = k * out[f"decode_off_{t}ms"] + out[f"mixed_off_{t}ms"]
        on = k * out[f"decode_on_{t}ms"] + out[f"mixed_on_{t}ms"]
        out[f"mixed_{t}ratio"] = out[f"mixed_on_{t}ms"] / out[f"mixed_off_{t}ms"]
        out[f"decode_{t}ratio"] = out[f"decode_on_{t}ms"] / out[f"decode_off_{t}ms"]
        out[f"serving_{t}cost"] = on / off - 1.0
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    r = measure(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['streams']} decoding streams at {r['context']} tokens; mixed step = them + a {r['prompt']}-token "
          f"prompt chunk; {r['dtype']}, weight quant {r['weight_quant']}, {r['threads']} threads, "
          f"median of {r['rounds']} steps each, modes alternated step by step")
    print(f"{'step':10s}{'on ms':>10s}{'off ms':>10s}{'on/off':>8s}{'on cpu':>10s}{'off cpu':>10s}{'on/off':>8s}")
    for kind in ("decode", "mixed"):
        print(f"{kind:10s}{r[f'{kind}_on_ms']:10.1f}{r[f'{kind}_off_ms']:10.1f}{r[f'{kind}_ratio']:8.3f}"
              f"{r[f'{kind}_on_cpu_ms']:10.1f}{r[f'{kind}_off_cpu_ms']:10.1f}{r[f'{kind}_cpu_ratio']:8.3f}")
    print(f"serving cost, one mixed step per {args.decode_steps_per_prompt:g} decode steps: "
          f"{100 * r['serving_cost']:+.1f} % (wall), {100 * r['serving_cpu_cost']:+.1f} % (CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
