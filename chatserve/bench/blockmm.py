"""`chatserve bench blockmm`: ms per call and GFLOP/s of the GGUF block-format matmuls per format and ISA
level, cpu_blockmm (`FMT/isa`: fp32 dequantization, the prompt rows) and cpu_blockq8 (`FMT/q8xBITS-isa`:
8- or 15-bit activations against the codes, the generated rows; `FMT/q8xBITS-tiled-isa`: the same on the
row-interleaved copy), beside today's CPU paths on the same shapes: torch's dense fp32 linear (`torch-fp32`,
what a float32 model runs), oneDNN's packed bf16 linear (prefill; where oneDNN packs bf16) and cpu_qmatmul's
int4/int8 repack (decode; where it runs). --before FILE adds another cpu_blockmm.c built at the same levels
(`FMT/isa-before`, e.g. main's: `git show main:kernels/cpu_blockmm.c > /tmp/before.c`). Random blocks (speed
does not depend on the values); per shape and M the calls alternate, best of --repeats each (wall time, or
with --clock thread the calling thread's CPU time), with the weights hot in cache, so memory-bound rows read
as upper bounds.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import time
from pathlib import Path
from typing import Callable

SHAPES = "576x576,192x576,1536x576,576x1536,49152x576,2048x2048,512x2048,8192x2048,2048x8192"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench blockmm", description=__doc__)
    p.add_argument("--formats", default="Q4_1,Q4_0,Q8_0,Q4_K,Q6_K", help="comma list of block formats")
    p.add_argument("--isas", default="avx512,avx2", help="levels to run (those this CPU lacks are left out)")
    p.add_argument("--q8-isas", default="avx512,avx2,avx2-maddubs",
                   help="cpu_blockq8 levels (avx2-maddubs: AVX2 without AVX-VNNI); empty: none")
    p.add_argument("--q8-max-rows", type=int, default=16, help="run cpu_blockq8 up to this M (decode rows)")
    p.add_argument("--x-bits", default="15", help="cpu_blockq8's x codes: comma list of 8, 15 (15 serves)")
    p.add_argument("--shapes", default=SHAPES, help="comma list of NxK (output features x input features)")
    p.add_argument("--rows", default="1,16,256", help="comma list of M (rows of x per call)")
    p.add_argument("--x-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="x's dtype (float32: what a float32 model's prompt rows pass)")
    p.add_argument("--before", type=Path, default=None,
                   help="another cpu_blockmm.c to time beside this tree's (rows FMT/isa-before)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="thread: the calling thread's CPU time for the alternated rows (--threads 1 only: the "
                        "time a shared box's other processes take the core is not counted)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", action="store_true")
    return p


def _alternated_ms(fns: dict[str, Callable[[], object]], repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Best ms of each call, the calls taking turns (a load change hits every row alike)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = clock()
            fn()
            best[key] = min(best[key], clock() - t0)
    return {key: v * 1e3 for key, v in best.items()}


def _before_library(source: Path, isa: str):
    """`source` (a cpu_blockmm.c) built at level `isa`, bound like cpu_blockmm.library's."""
    from chatserve_kernels import cpu_blockmm, cpu_build
    lib = cpu_build.load(cpu_blockmm.level_source(source, f"{isa}_before", cpu_blockmm._PRELUDE[isa]))
    if lib is None:
        raise SystemExit(f"--before {source}: does not build at level {isa}")
    lib.chatserve_bmm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_int, ctypes.c_int]
    if hasattr(lib, "chatserve_bmm_amx"):      # a source with the AMX path: as this tree's is set (CHATSERVE_AMX)
        lib.chatserve_bmm_amx.argtypes = [ctypes.c_int]
        lib.chatserve_bmm_amx(int(cpu_blockmm.amx(isa)))
    return lib


def _call(lib, x, w, threads: int):
    import torch
    y = torch.empty(x.shape[0], w.n, dtype=x.dtype)
    if lib.chatserve_bmm(w.fmt.type_id, w.data.data_ptr(), w.row_bytes, w.n, w.k, x.data_ptr(), x.shape[0],
                         int(x.dtype == torch.bfloat16), y.data_ptr(), w.n, int(y.dtype == torch.bfloat16), threads):
        raise RuntimeError(f"--before kernel failed on {w.fmt.name}")
    return y


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _baselines(wb, x, m: int, repeats: int) -> dict[str, float]:
    import torch

    from chatserve_kernels import cpu_qmatmul
    out = {}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(wb, None)
    except RuntimeError:        # oneDNN packs bf16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT: no such row
        packed = None
    if packed is not None:
        xb = x.bfloat16()       # what a bf16 model's prompt rows pass (oneDNN's bf16 weights refuse fp32 x)
        out["onednn-bf16"] = _best_ms(lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
                                      repeats)
    if m <= 16 and cpu_qmatmul.available():
        for bits in (4, 8):
            qw = cpu_qmatmul.pack(*cpu_qmatmul.quantize(wb, bits), bits)
            out[f"qmatmul-int{bits}"] = _best_ms(lambda: cpu_qmatmul.matmul(x, qw), repeats)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from chatserve_kernels import block_formats, cpu_blockmm, cpu_blockq8
    torch.set_num_threads(args.threads)
    isas = [i for i in args.isas.split(",") if cpu_blockmm.available(i)]
    before = {i: _before_library(args.before, i) for i in isas} if args.before else {}
    xdtype = getattr(torch, args.x_dtype)
    if args.clock == "thread" and args.threads != 1:
        raise SystemExit("--clock thread needs --threads 1 (other threads' CPU time is not the caller's)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    q8_isas = [i for i in args.q8_isas.split(",") if i and cpu_blockq8.available(i)]
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        wb = (torch.randn(n, k) * 0.02).bfloat16()
        weights = {f: block_formats.random_weight(f, n, k) for f in args.formats.split(",")
                   if k % block_formats.FORMATS[f].block == 0}          # K-quants need K % 256 == 0
        tiled: dict = {}
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k).to(xdtype)
            ms = _baselines(wb, x, m, args.repeats)
            dense = wb.float()
            fns: dict[str, Callable[[], object]] = {"torch-fp32": lambda: torch.nn.functional.linear(x.float(), dense)}
            for f, w in weights.items():
                for isa in isas:
                    fns[f"{f}/{isa}"] = functools.partial(cpu_blockmm.matmul, x, w, isa, threads=args.threads)
                    if isa in before:
                        fns[f"{f}/{isa}-before"] = functools.partial(_call, before[isa], x, w, args.threads)
            ms.update(_alternated_ms(fns, args.repeats, clock))
            for f, w in weights.items():
                for isa in q8_isas if m <= args.q8_max_rows and cpu_blockq8.handles(w) else ():
                    for bits in (int(b) for b in args.x_bits.split(",")):
                        ms[f"{f}/q8x{bits}-{isa}"] = _best_ms(
                            lambda: cpu_blockq8.matmul(x, w, isa, threads=args.threads, x_bits=bits), args.repeats)
                        if cpu_blockq8.tiles(isa, w):           # the row-interleaved copy, re-laid at load
                            tw = tiled.setdefault((f, isa), cpu_blockq8.tile(w, isa))
                            ms[f"{f}/q8x{bits}-tiled-{isa}"] = _best_ms(
                                lambda: cpu_blockq8.matmul_tiled(x, tw, isa, threads=args.threads, x_bits=bits),
                                args.repeats)
            rows.append({"n": n, "k": k, "m": m, "ms": ms,
                         "gflops": {key: 2 * m * n * k / (v * 1e6) for key, v in ms.items()}})
            if not args.json:
                print(f"{n}x{k} M={m}: " + ", ".join(f"{key} {v:.3f} ms ({2 * m * n * k / (v * 1e6):.0f} GF/s)"
                                                     for key, v in ms.items()), flush=True)
    return rows


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    rows = run(args)
    if args.json:
        print(json.dumps({"threads": args.threads, "rows": rows}))
    return 0
