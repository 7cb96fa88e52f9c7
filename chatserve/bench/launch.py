"""`chatserve bench launch`: load time, peak RSS and decode-step time of chatserve and (given
`--llama-cpp-python`) llama.cpp on one GGUF file, each variant in a fresh process, one at a time, the
variants alternated over `--repeats` rounds (issue 30's and 32's "llama.cpp beside chatserve" figures).

chatserve runs its runner as `bench model` does (the step a server runs: forward, LM head, greedy sample);
llama.cpp runs through llama-cpp-python's low-level API (`llama_decode` on a batch holding one token of each
of B sequences, `n_seq_max` = B: what its server's parallel slots do each step, then an argmax per row).
Each step is reported against the bandwidth floor: the weight bytes a step reads ÷ the read bandwidth
measured here. Not a server benchmark (no HTTP, no tokenizer): `bench serve` is.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("default", "in-place", "llama.cpp")

# llama.cpp through llama-cpp-python, run by its own interpreter in a temp dir (our kernels/ folder would
# shadow a PyPI package of that name); prints one JSON line
LLAMA_CPP_SCRIPT = r'''
import json, statistics, sys, time
import numpy as np
import llama_cpp as L

a = json.loads(sys.argv[1])
def peak():                # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's across exec)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
L.llama_backend_init()
t0 = time.perf_counter()
mp = L.llama_model_default_params()
mp.use_extra_bufts = a["extra_bufts"]     # AMX / repacked weights: off by default (AMX segfaults on some VMs)
model = L.llama_model_load_from_file(a["path"].encode(), mp)
if not model:
    raise SystemExit("llama.cpp could not load " + a["path"])
per_seq = a["context"] + a["steps"] + a["warmup"] + 8
cp = L.llama_context_default_params()
B = max(a["batches"])
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = per_seq * B, 512, 512, B
cp.n_threads = cp.n_threads_batch = a["threads"]
ctx = L.llama_init_from_model(model, cp)
load_s = time.perf_counter() - t0
rss_load = peak()
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(512, 0, B)

def clear():
    if hasattr(L, "llama_memory_clear"):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
    else:
        L.llama_kv_self_clear(ctx)

def submit(rows):          # rows: (token, pos, seq, wants logits)
    batch.n_tokens = len(rows)
    for i, (tok, pos, seq, lg) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, lg
        batch.seq_id[i][0] = seq
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")

prompt = [(17 * i + 5) % vocab for i in range(a["context"])]
results = []
for b in a["batches"]:
    clear()
    for s in range(b):                                       # prefill, untimed
        submit([(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)])
    last, times = [prompt[-1]] * b, []
    for i in range(a["steps"] + a["warmup"]):
        pos = a["context"] + i
        t = time.perf_counter()
        submit([(last[s], pos, s, True) for s in range(b)])
        last = [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s), shape=(vocab,)).argmax())
                for s in range(b)]
        dt = time.perf_counter() - t
        if i >= a["warmup"]:
            times.append(dt)
    med = statistics.median(times)
    results.append({"batch": b, "step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3,
                    "tokens_per_s": b / med})
print(json.dumps({"variant": "llama.cpp", "load_s": load_s, "peak_rss_mib_load": rss_load,
                  "peak_rss_mib": peak(), "decode": results, "system_info": L.llama_print_system_info().decode()}))
'''


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would keep the forking parent's peak across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def chatserve_child(a: dict) -> dict:
    """One chatserve variant in this process: load, then the decode steps of each batch size."""
    from chatserve.bench.model import _decode
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner

    in_place = a["variant"] == "in-place"
    per_seq = -(-(a["context"] + a["steps"] + a["warmup"] + 2) // 16)
    t0, c0 = time.perf_counter(), time.process_time()
    runner = ModelRunner.from_config(offline_config(
        a["path"], dtype=a["dtype"], num_threads=a["threads"], weight_quant=None if in_place else "auto",
        gguf_in_place=in_place, cpu_isa=a["cpu_isa"], block_size=16,
        num_blocks=per_seq * max(a["batches"])), progress=False)
    load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    rss_load = peak_rss_mib()
    # a warm load maps the tiled cache file, a cold one builds it: say which, the load times differ 10-100×
    store = getattr(getattr(runner.model.lm_head, "w", None), "store", None)
    tiled_cache = None if not in_place else "off" if store is None else "built" if store.built else "mapped"
    results = []
    for b in a["batches"]:
        d = _decode(runner, b, a["context"], a["steps"], warmup=a["warmup"])
        d["weight_bytes_per_step"] = runner.model.decode_weight_bytes(b)
        results.append(d)
    return {"variant": a["variant"], "load_s": load_s, "load_cpu_s": load_cpu_s, "tiled_cache": tiled_cache,
            "peak_rss_mib_load": rss_load,
            "peak_rss_mib": peak_rss_mib(), "decode": results, "backends": runner.model.describe_backends()}


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """Run one variant in a fresh process; its JSON result with the load average before and after."""
    a = {"variant": variant, "path": str(Path(args.model).resolve()), "dtype": args.dtype, "cpu_isa": args.cpu_isa,
         "threads": args.threads, "batches": args.batches, "context": args.context, "steps": args.steps,
         "warmup": args.warmup, "extra_bufts": args.llama_cpp_extra_bufts}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        if variant == "llama.cpp":
            (Path(d) / "run.py").write_text(LLAMA_CPP_SCRIPT)
            cmd, cwd = [args.llama_cpp_python, "run.py", json.dumps(a)], d
        else:
            # in the temp dir too: a checkout's folders in the cwd would shadow the installed package
            cmd, cwd = [sys.executable, "-m", "chatserve.bench.launch", "--child", json.dumps(a)], d
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"variant": variant, "error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["failed"],
                "load_average": [load_before, os.getloadavg()[0]]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["load_average"] = [load_before, os.getloadavg()[0]]
    return out


def add_floor(r: dict, bandwidth: float, file_bytes: dict[int, int]) -> None:
    """Each decode row against its floor (weight bytes ÷ bandwidth); llama.cpp reads the file's own
    blocks, whose bytes per step are chatserve in-place's count (file_bytes, per batch)."""
    for d in r.get("decode", []):
        wb = d.get("weight_bytes_per_step") or file_bytes.get(d["batch"])
        if wb:
            d["weight_bytes_per_step"] = wb
            d["floor_ms"] = wb / bandwidth * 1e3
            d["vs_floor"] = d["step_ms_median"] / d["floor_ms"]


def format_row(r: dict, file_gib: float) -> str:
    la = "load average {:.1f}→{:.1f}".format(*r["load_average"])
    if "error" in r:
        return f"  {r['variant']:10s} FAILED: {r['error'][0]} ({la})"
    cache = f" (tiled cache {r['tiled_cache']})" if r.get("tiled_cache") else ""
    rows = [f"  {r['variant']:10s} load {r['load_s']:.1f} s{cache}, peak RSS {r['peak_rss_mib_load'] / 1024:.2f} GiB "
            f"after load, {r['peak_rss_mib'] / 1024:.2f} GiB after decode ({r['peak_rss_mib'] / 1024 / file_gib:.2f}× "
            f"the file) ({la})"]
    for d in r["decode"]:
        floor = (f"; floor {d['floor_ms']:.1f} ms ({d['weight_bytes_per_step'] / 1e6:.0f} MB), "
                 f"{d['vs_floor']:.2f}× it" if "floor_ms" in d else "")
        rows.append(f"      batch {d['batch']:3d}: step {d['step_ms_median']:.1f} ms median, "
                    f"{d['step_ms_min']:.1f} best, {d['tokens_per_s']:.1f} tok/s{floor}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--variants", default="in-place,llama.cpp,default",
                   help=f"comma-separated, run in this order each round: {', '.join(VARIANTS)} (llama.cpp "
                        "needs --llama-cpp-python)")
    p.add_argument("--llama-cpp-python", default=None, help="a Python interpreter that imports llama_cpp")
    p.add_argument("--llama-cpp-extra-bufts", action="store_true",
                   help="let llama.cpp use its extra buffer types (AMX, repacked weights); off: llama.cpp "
                        "0.3.36's AMX matmul segfaults on the Sapphire Rapids VM this was written on")
    p.add_argument("--dtype", default="bfloat16", help="chatserve's activation dtype")
    p.add_argument("--cpu-isa", default="auto",
                   help="chatserve's block-kernel level (avx2 on an AVX-512 CPU: what an AVX2-only box runs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1", help="decode batch sizes (streams), comma-separated")
    p.add_argument("--context", type=int, default=32, help="prompt tokens before the timed decode steps")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds over the variants")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer of the read-bandwidth measure (0: none)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one variant may take")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:                   # one chatserve variant, in the process run_variant started
        print(json.dumps(chatserve_child(json.loads(argv[1]))))
        return 0
    args = build_parser().parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants: each of {', '.join(VARIANTS)}")
    if "llama.cpp" in variants and not args.llama_cpp_python:
        raise SystemExit("--variants llama.cpp needs --llama-cpp-python")
    from chatserve.bench.model import read_bandwidth

    bandwidth = read_bandwidth(args.bandwidth_mib) if args.bandwidth_mib > 0 else None
    file_gib = Path(args.model).stat().st_size / 2**30
    if not args.json:
        bw = f"; read bandwidth {bandwidth / 1e9:.1f} GB/s" if bandwidth else ""
        print(f"{args.model}: {file_gib:.2f} GiB; {args.threads} threads{bw}", flush=True)
    rounds: list[list[dict]] = []
    file_bytes: dict[int, int] = {}
    for _ in range(args.repeats):
        rows = []
        for v in variants:
            r = run_variant(v, args)
            if v == "in-place":
                file_bytes = {d["batch"]: d["weight_bytes_per_step"] for d in r.get("decode", [])}
            if bandwidth:                  # llama.cpp's floor needs in-place's count: list in-place first
                add_floor(r, bandwidth, file_bytes)
            if not args.json:
                print(format_row(r, file_gib), flush=True)
            rows.append(r)
        rounds.append(rows)
    if args.json:
        print(json.dumps({"model": args.model, "file_gib": file_gib, "threads": args.threads,
                          "read_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None, "rounds": rounds},
                         indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
