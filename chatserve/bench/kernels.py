"""`chatserve bench kernels`: GPU bandwidth of paged decode attention; quality cost of KV quantization.

Decode (needs CUDA): time, achieved bandwidth, fraction of the device's peak and of a device-to-device
copy, against SDPA on contiguous K/V and FlashInfer / flash-attn when installed. `--quality` (CPU or
GPU): logit error and greedy agreement of int8/fp8 KV caches on the default model. Not a serving benchmark.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "H800": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6, "L4": 0.3}

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "Give me three tips for learning Python.", "What is 17 times 23?", "Who wrote Romeo and Juliet?",
    "Describe a cat in two sentences.", "How do airplanes stay in the air?",
    "Translate 'good morning' to Spanish.",
    "What causes rain?", "Name three primary colors.", "Why is the sky blue?", "Tell me a short joke.",
    "What is a prime number?", "How many days are in a leap year?", "Summarize the plot of Cinderella.",
    "What does a CPU do?", "Suggest a name for a pet goldfish.", "What is the boiling point of water?",
    "List the planets of the solar system.",
]


# ============================================================================ decode bandwidth (CUDA)
@dataclass
class DecodeRow:
    batch: int
    context: int
    kv_bytes: int                 # K/V (+ scales) + Q bytes one call reads
    num_splits: int
    triton_us: float
    triton_gbps: float
    frac_peak: float | None
    frac_copy: float
    sdpa_us: float | None = None
    sdpa_gbps: float | None = None
    others: dict[str, float | str] = field(default_factory=dict)   # name → µs, or why it was skipped


_DEV = "cuda"   # "cpu" only for `--dry-run`: the same code path through the interpreter, timings meaningless


def _bench_us(fn, warmup: int = 10, rep_ms: int = 100) -> float:
    """Median µs of fn() with the L2 flushed between calls (triton.testing.do_bench)."""
    if _DEV == "cpu":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


def _sync() -> None:
    if _DEV == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: (read + write bytes) / time, the practical ceiling for a streaming kernel."""
    if _DEV == "cpu":
        nbytes = 1 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=_DEV)
    dst = torch.empty_like(src)
    us = _bench_us(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e9


def peak_tbps(name: str) -> float | None:
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    return None


def _decode_case(batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
                 kv_cache_dtype: str):
    from chatserve_kernels import AttentionMetadata, allocate_kv_cache

    nblk = -(-ctx // bs)
    nb = batch * nblk
    k, v, ks, vs = allocate_kv_cache(nb, bs, hkv, d, dtype, kv_cache_dtype, _DEV)
    for t in (k, v):
        if t.dtype in (torch.int8, torch.float8_e4m3fn):
            t.view(torch.uint8).random_(0, 0x70)         # in place: finite codes, no fp32 temporary
        else:
            t.normal_()
    for s in (ks, vs):
        if s is not None and s.dim() == 3:
            s.uniform_(0.005, 0.02)
    perm = torch.randperm(nb).view(batch, nblk).tolist()           # scattered blocks, like a live server
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, perm, bs, _DEV)
    q = torch.randn(batch, hq, d, dtype=dtype, device=_DEV)
    return q, k, v, ks, vs, meta, perm


def _others(q, k, v, meta, perm, ctx, bs, scale) -> dict[str, float | str]:
    """FlashInfer / flash-attn on the same problem, when installed (their own cache layouts)."""
    res: dict[str, float | str] = {}
    B, hq, d = q.shape
    hkv = k.shape[2]
    try:
        import flashinfer  # optional GPU package, not installed (no stubs either)

        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrap = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        nblk = -(-ctx // bs)
        indptr = torch.arange(0, (B + 1) * nblk, nblk, dtype=torch.int32, device="cuda")
        indices = torch.tensor(perm, dtype=torch.int32, device="cuda").flatten()
        last = torch.full((B,), ctx - (nblk - 1) * bs, dtype=torch.int32, device="cuda")
        wrap.plan(indptr, indices, last, hq, hkv, d, bs, q_data_type=q.dtype, kv_data_type=k.dtype,
                  sm_scale=scale)
        res["flashinfer_us"] = _bench_us(lambda: wrap.run(q, (k, v)))
    except ImportError:
        res["flashinfer_us"] = "not installed"
    except Exception as e:  # noqa: BLE001 - a baseline failing must not end the benchmark
        res["flashinfer_us"] = f"failed: {type(e).__name__}: {e}"[:120]
    try:
        from flash_attn import flash_attn_with_kvcache  # optional GPU package, not installed

        page = 256                                   # flash-attn's paged KV wants pages of 256 tokens
        npg = -(-ctx // page)
        kc = torch.randn(B * npg, page, hkv, d, dtype=q.dtype, device="cuda")
        vc = torch.randn_like(kc)
        table = torch.randperm(B * npg, device="cuda").view(B, npg).to(torch.int32)
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        q4 = q[:, None]
        res["flash_attn_us"] = _bench_us(lambda: flash_attn_with_kvcache(
            q4, kc, vc, cache_seqlens=lens, block_table=table, softmax_scale=scale))
        del kc, vc
    except ImportError:
        res["flash_attn_us"] = "not installed"
    except Exception as e:  # noqa: BLE001
        res["flash_attn_us"] = f"failed: {type(e).__name__}: {e}"[:120]
    return res


def run_decode(args) -> dict:
    from chatserve_kernels import paged_attention
    from chatserve_kernels.decode_attention import choose_num_splits, decode_config

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    hq, hkv, d, bs = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    name = torch.cuda.get_device_name() if _DEV == "cuda" else "cpu (dry run)"
    peak = args.peak_tbps or peak_tbps(name)
    copy_gbps = copy_bandwidth_gbps()
    scale = d ** -0.5
    rows: list[DecodeRow] = []
    for batch in args.batches:
        for ctx in args.contexts:
            elem = torch.empty((), dtype=dtype).element_size() if args.kv_cache_dtype == "auto" else 1
            kv = 2 * batch * ctx * hkv * d * elem
            if kv > args.max_kv_gb * 1e9:
                continue
            q, k, v, ks, vs, meta, perm = _decode_case(batch, ctx, hq, hkv, d, bs, dtype, args.kv_cache_dtype)
            nbytes = kv + q.numel() * q.element_size() * 2
            if ks is not None and ks.dim() == 3:
                nbytes += 2 * batch * ctx * hkv * 4
            fn = lambda: paged_attention(q, k, v, meta, scale, k_scale=ks, v_scale=vs)  # noqa: E731
            us = _bench_us(fn)
            gbps = nbytes / (us * 1e-6) / 1e9
            row = DecodeRow(batch, ctx, nbytes, choose_num_splits(batch, hkv, ctx, q.device), round(us, 2),
                            round(gbps, 1), round(gbps / (peak * 1e3), 3) if peak else None,
                            round(gbps / copy_gbps, 3))
            if args.kv_cache_dtype == "auto" and 2 * kv < args.max_kv_gb * 1e9:
                try:  # attention over gathered, contiguous K/V (the gather itself is not timed)
                    idx = torch.tensor(perm, device=_DEV)
                    kc = k[idx].flatten(1, 2)[:, :ctx].transpose(1, 2)
                    vc = v[idx].flatten(1, 2)[:, :ctx].transpose(1, 2)
                    kc, vc = kc.contiguous(), vc.contiguous()                  # [B, hkv, ctx, d]
                    q4 = q[:, :, None]
                    sus = _bench_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q4, kc, vc, scale=scale, enable_gqa=hq != hkv))
                    row.sdpa_us, row.sdpa_gbps = round(sus, 2), round(nbytes / (sus * 1e-6) / 1e9, 1)
                    del kc, vc
                except Exception as e:  # noqa: BLE001
                    row.others["sdpa"] = f"failed: {type(e).__name__}"
                if not args.no_baselines:
                    row.others.update(_others(q, k, v, meta, perm, ctx, bs, scale))
            rows.append(row)
            print(_fmt_row(row), file=sys.stderr, flush=True)
            del q, k, v, ks, vs, meta
            _sync()
    return {
        "benchmark": "kernels.decode",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": name, "peak_tbps": peak, "copy_gbps": round(copy_gbps, 1),
        "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "block_size": bs, "dtype": args.dtype,
                  "kv_cache_dtype": args.kv_cache_dtype},
        "config": decode_config(d, torch.device(_DEV)), "torch": torch.__version__,
        "rows": [asdict(r) for r in rows],
    }


def run_tune(args) -> dict:
    """Sweep the decode kernel's tile size, warps and stages on a few shapes; print the best of each."""
    from chatserve_kernels.decode_attention import decode_attention_triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    hq, hkv, d, bs = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    out = []
    for batch, ctx in ((1, 32768), (16, 8192), (64, 4096), (256, 2048)):
        q, k, v, ks, vs, meta, _ = _decode_case(batch, ctx, hq, hkv, d, bs, dtype, args.kv_cache_dtype)
        nbytes = 2 * batch * ctx * hkv * d * k.element_size()
        res = []
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    o = torch.empty_like(q)
                    fn = lambda: decode_attention_triton(  # noqa: E731
                        q, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc, ctx, d ** -0.5, o,
                        ks, vs, block_n=block_n, num_warps=warps, num_stages=stages)
                    try:
                        us = _bench_us(fn, warmup=3, rep_ms=50)
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        print(f"  block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}",
                              file=sys.stderr)
                        continue
                    res.append({"block_n": block_n, "num_warps": warps, "num_stages": stages,
                                "us": round(us, 2), "gbps": round(nbytes / (us * 1e-6) / 1e9, 1)})
        res.sort(key=lambda r: r["us"])
        out.append({"batch": batch, "context": ctx, "best": res[:3]})
        print(f"batch {batch} ctx {ctx}: best {res[:1]}", file=sys.stderr, flush=True)
        del q, k, v
        _sync()
    return {"benchmark": "kernels.tune", "device": torch.cuda.get_device_name(), "results": out}


def _fmt_row(r: DecodeRow) -> str:
    peak = f"{100 * r.frac_peak:5.1f}%" if r.frac_peak is not None else "   n/a"
    sdpa = f"{r.sdpa_us:9.1f}" if r.sdpa_us is not None else "        -"
    extra = " ".join(f"{k}={v if isinstance(v, str) else round(v, 1)}" for k, v in r.others.items())
    return (f"{r.batch:6d} {r.context:7d} {r.kv_bytes / 1e6:10.1f} {r.num_splits:6d} {r.triton_us:9.1f} "
            f"{r.triton_gbps:8.1f} {peak} {100 * r.frac_copy:6.1f}% {sdpa}  {extra}")


def print_decode_table(res: dict) -> None:
    print(f"# paged decode attention — {res['device']}, {res['date']}")
    print(f"# shape {res['shape']}, kernel config {res['config']}")
    print(f"# device-to-device copy: {res['copy_gbps']} GB/s; peak: {res['peak_tbps']} TB/s")
    print(f"{'batch':>6} {'context':>7} {'MB read':>10} {'splits':>6} {'us':>9} {'GB/s':>8} {'%peak':>6} "
          f"{'%copy':>7} {'sdpa_us':>9}  others")
    for r in res["rows"]:
        print(_fmt_row(DecodeRow(**r)))


# ============================================================================ quantization quality
def greedy_generate(model, prompts: list[list[int]], steps: int, kv_cache_dtype: str = "auto",
                    block_size: int = 16, teacher: list[list[int]] | None = None,
                    ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding of `prompts` on a LlamaModel with a fresh paged cache of kv_cache_dtype.

    teacher: feed these tokens instead of the argmax (teacher forcing). Returns the chosen tokens per
    prompt and the logits [N, V] float32 (on CPU) of every step.
    """
    from chatserve_kernels import AttentionMetadata, allocate_kv_cache

    cfg, dev = model.config, model.device
    n = len(prompts)
    nbps = -(-(max(len(p) for p in prompts) + steps) // block_size)
    caches = [allocate_kv_cache(n * nbps, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                                kv_cache_dtype, dev) for _ in range(cfg.num_layers)]
    # the model's one attention call site takes (k, v) or (k, v, k_scale, v_scale) per layer
    kv = [c if c[2] is not None else (c[0], c[1]) for c in caches]
    tables = [list(range(i * nbps, (i + 1) * nbps)) for i in range(n)]
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device=dev)
    meta = AttentionMetadata.build(lens, lens, tables, block_size, dev)
    with torch.inference_mode():
        hidden = model.forward(ids, pos, kv, meta)                         # [T, H]
        last = torch.tensor([sum(lens[:i + 1]) - 1 for i in range(n)], device=dev)
        logits = model.compute_logits(hidden[last])                        # [N, V]
        chosen: list[list[int]] = [[] for _ in range(n)]
        all_logits = []
        for t in range(steps):
            all_logits.append(logits.float().cpu())
            nxt = logits.argmax(-1).tolist() if teacher is None else [teacher[i][t] for i in range(n)]
            for i in range(n):
                chosen[i].append(int(nxt[i]))
            if t == steps - 1:
                break
            pos = torch.tensor(lens, device=dev)
            lens = [x + 1 for x in lens]
            meta = AttentionMetadata.build([1] * n, lens, tables, block_size, dev)
            hidden = model.forward(torch.tensor(nxt, device=dev), pos, kv, meta)
            logits = model.compute_logits(hidden)
    return chosen, all_logits


def load_default_model(dtype: str = "float32", device: str = "cpu"):
    """The default model (LlamaModel) and its tokenizer's chat-templated ids for PROMPTS."""
    from chatserve.config import default_model_path
    from chatserve.runtime.models.llama import LlamaModel
    from chatserve.runtime.weights import load_weights, torch_dtype
    from chatserve.text import Tokenizer

    path = default_model_path()
    if path is None:
        raise FileNotFoundError("the default model is not installed")
    w = load_weights(path, torch_dtype(dtype), progress=False)
    model = LlamaModel(w.config, w.tensors, torch_dtype(dtype), device, max_model_len=2048)
    tok = Tokenizer.from_model(path)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    return model, ids


def run_quality(args) -> dict:
    dev = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, prompts = load_default_model(args.model_dtype, dev)
    prompts = prompts[:args.prompts]
    ref_tokens, ref_logits = greedy_generate(model, prompts, args.max_tokens, "auto")
    ref = torch.stack(ref_logits)                                              # [steps, N, V]
    out = {"benchmark": "kernels.quality", "device": dev, "model_dtype": args.model_dtype,
           "prompts": len(prompts), "max_tokens": args.max_tokens, "reference": "auto (model dtype) cache",
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "results": []}
    for kvd in args.kv_cache_dtypes:
        _, tf_logits = greedy_generate(model, prompts, args.max_tokens, kvd, teacher=ref_tokens)
        got = torch.stack(tf_logits)
        diff = (got - ref).abs()
        lp_ref, lp = ref.log_softmax(-1), got.log_softmax(-1)
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)                            # [steps, N]
        free_tokens, _ = greedy_generate(model, prompts, args.max_tokens, kvd)
        same = sum(a == b for a, b in zip(free_tokens, ref_tokens))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(free_tokens, ref_tokens)]
        res = {"kv_cache_dtype": kvd,
               "max_abs_logit_err": round(diff.max().item(), 4),
               "mean_abs_logit_err": round(diff.mean().item(), 5),
               "rel_rms_logit_err": round((diff.norm() / ref.norm()).item(), 5),
               "mean_kl": round(kl.mean().item(), 6),
               "top1_agree_teacher_forced":
                   round((got.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
               "greedy_identical": f"{same}/{len(prompts)}",
               "greedy_mean_matching_prefix": round(sum(prefix) / len(prefix), 2)}
        out["results"].append(res)
        print(json.dumps(res), file=sys.stderr, flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def print_quality_table(res: dict) -> None:
    print(f"# KV-cache quantization quality — default model, {res['model_dtype']} on {res['device']}, "
          f"{res['prompts']} prompts × {res['max_tokens']} greedy tokens, vs {res['reference']}")
    cols = ["kv_cache_dtype", "max_abs_logit_err", "mean_abs_logit_err", "rel_rms_logit_err", "mean_kl",
            "top1_agree_teacher_forced", "greedy_identical", "greedy_mean_matching_prefix"]
    print(" | ".join(cols))
    for r in res["results"]:
        print(" | ".join(str(r[c]) for c in cols))


# ============================================================================ CLI
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--batches", type=_ints, default=[1, 4, 16, 64, 256])
    p.add_argument("--contexts", type=_ints, default=[512, 2048, 8192, 16384, 32768])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | int8 | fp8 | fp8_per_tensor")
    p.add_argument("--max-kv-gb", type=float, default=24.0, help="skip shapes whose K/V exceed this")
    p.add_argument("--peak-tbps", type=float, default=None, help="device peak (default: by device name)")
    p.add_argument("--no-baselines", action="store_true", help="skip FlashInfer / flash-attn")
    p.add_argument("--tune", action="store_true", help="sweep the decode kernel's tile configs instead")
    p.add_argument("--quality", action="store_true",
                   help="measure int8/fp8 KV quality on the default model (runs on CPU too)")
    p.add_argument("--kv-cache-dtypes", type=lambda s: s.split(","),
                   default=["int8", "fp8", "fp8_per_tensor"], help="for --quality")
    p.add_argument("--prompts", type=int, default=20, help="for --quality")
    p.add_argument("--max-tokens", type=int, default=32, help="for --quality")
    p.add_argument("--model-dtype", default="float32", help="for --quality")
    p.add_argument("--cpu", action="store_true", help="--quality on CPU even when CUDA is present")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for --quality")
    p.add_argument("--dry-run", action="store_true",
                   help="run the decode bench code on CPU through the Triton interpreter (no timings)")
    return p


def _dry_run(args) -> int:
    """The decode benchmark on CPU via the interpreter; the process's env and device are restored after."""
    global _DEV
    import os

    from chatserve_kernels.env import FORCE_TRITON    # the kernels' own switch (kernels/env.py)
    saved = os.environ.get(FORCE_TRITON)
    os.environ[FORCE_TRITON] = "1"
    _DEV = "cpu"
    try:
        res = run_decode(args)
    finally:
        _DEV = "cuda"
        if saved is None:
            os.environ.pop(FORCE_TRITON, None)
        else:
            os.environ[FORCE_TRITON] = saved
    print(json.dumps(res, indent=1)) if args.json else print_decode_table(res)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quality:
        res = run_quality(args)
        print(json.dumps(res, indent=1)) if args.json else print_quality_table(res)
        return 0
    if args.dry_run:
        return _dry_run(args)
    if not torch.cuda.is_available():
        msg = "chatserve bench kernels: needs CUDA (no GPU visible); nothing measured"
        print(json.dumps({"benchmark": "kernels.decode", "skipped": "needs CUDA"}) if args.json else msg)
        return 0
    from chatserve_kernels.dispatch import HAS_TRITON
    if not HAS_TRITON:
        print("chatserve bench kernels: needs triton (pip install triton)", file=sys.stderr)
        return 1
    if args.tune:
        res = run_tune(args)
        print(json.dumps(res, indent=1))
        return 0
    res = run_decode(args)
    print(json.dumps(res, indent=1)) if args.json else print_decode_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
