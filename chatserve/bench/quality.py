"""`chatserve bench quality`: how closely chatserve's logits follow a GGUF file's own weights (issue 30).

The reference is transformers (float32) on the file as transformers itself reads it: its GGUF loader
turns the metadata keys into a config and dequantizes every tensor with gguf-py (llama.cpp's
`rope_freqs` factors, which that loader skips, divide its RoPE frequencies as llama.cpp does). Nothing
comes from chatserve's parse. Teacher-forced: a random prompt, then the reference's greedy continuation;
chatserve runs the prompt as one prefill step (prompt rows: the dense weights) and every later token as
a decode step (generated rows: the quantized copy, the C decode chain), and the top-1 agreement and the
largest logit difference are reported for prefill and decode positions apart, per dtype. With
`--llama-cpp-python` (an interpreter that imports llama_cpp, run outside this repository: our kernels/
shadows a PyPI package) the same tokens also go through llama.cpp and its max-abs difference is reported.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Agreement:
    """Teacher-forced top-1 agreement and max-abs logit difference, prefill and decode positions apart."""
    variant: str
    prefill_positions: int
    decode_positions: int
    prefill_top1: float
    decode_top1: float
    prefill_max_abs: float
    decode_max_abs: float
    logit_scale: float          # the reference's max |logit|, to read the differences against


def hf_reference(path: str | Path):
    """transformers' causal LM (float32, eval) built from the GGUF by transformers' own loader (built on the
    meta device and given the loader's tensors: one float32 copy of the weights, not two)."""
    import gguf
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    kw = dict(load_gguf_checkpoint(str(path))["config"])
    config = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    tied = "lm_head.weight" not in tensors
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and tied)]
    if missing or unexpected:
        raise ValueError(f"transformers' GGUF load left out {missing} / did not place {unexpected}")
    if tied:                                        # no output.weight in the file: the embedding is the head
        model.lm_head.weight = model.model.embed_tokens.weight
    rot = model.model.rotary_emb
    model.model.rotary_emb = rot = type(rot)(config=config)         # its buffers, off the meta device
    factors = next((t for t in gguf.GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:                        # llama3 RoPE as llama.cpp's converter stores it
        rot.inv_freq = rot.inv_freq / torch.from_numpy(factors.data.astype("float32").reshape(-1))
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ValueError(f"transformers' GGUF load left {on_meta} unset")
    return model.eval()


def reference_run(model, prompt: list[int], n_decode: int) -> tuple[list[int], torch.Tensor]:
    """(prompt + the reference's greedy continuation, its logits [len - 1, V] float32 predicting tokens 1..)."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n_decode, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        tokens = out[0].tolist()
        logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
    return tokens, logits


def chatserve_logits(runner, seqs: list[list[int]], n_prompt: int) -> list[torch.Tensor]:
    """Teacher-forced logits [len - 1, V] of each sequence, all of them batched in every step: positions
    below n_prompt as one prompt step, then each later token as a decode step (a generated row)."""
    import torch

    from chatserve.runtime.models.layers import RowSplit
    from chatserve_kernels import AttentionMetadata

    model, bs, dev = runner.model, runner.block_size, runner.device
    per = -(-max(map(len, seqs)) // bs)
    assert per * len(seqs) <= runner.num_blocks, "the runner's cache is too small for these sequences"
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(seqs))]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]

    def step(ids: list[list[int]], start: int, generated: bool) -> None:
        n = len(ids[0])
        meta = AttentionMetadata.build([n] * len(ids), [start + n] * len(ids), tables, bs, dev)
        rows = RowSplit.build([generated] * (n * len(ids)), dev)
        flat = torch.tensor([t for s in ids for t in s], device=dev)
        pos = torch.arange(start, start + n, device=dev).repeat(len(ids))
        h = model.forward(flat, pos, runner.kv_caches, meta, rows)                 # [B·n, H]
        logits = model.compute_logits(h).float().cpu().view(len(ids), n, -1)      # [B, n, V]
        for i in range(len(ids)):
            out[i].append(logits[i])

    with torch.inference_mode():
        step([s[:n_prompt] for s in seqs], 0, False)
        for p in range(n_prompt, len(seqs[0]) - 1):
            step([[s[p]] for s in seqs], p, True)
    return [torch.cat(o) for o in out]


def compare(variant: str, ours: torch.Tensor, ref: torch.Tensor, n_prompt: int) -> Agreement:
    """ours, ref [len - 1, V]: rows below n_prompt are prefill positions, the rest decode positions."""
    top = (ours.argmax(-1) == ref.argmax(-1)).float()
    diff = (ours - ref).abs().amax(-1)
    return Agreement(variant, n_prompt, len(top) - n_prompt, float(top[:n_prompt].mean()),
                     float(top[n_prompt:].mean()), float(diff[:n_prompt].max()), float(diff[n_prompt:].max()),
                     float(ref.abs().max()))


def llama_cpp_logits(python: str, path: str, tokens: list[int], threads: int | None) -> torch.Tensor:
    """llama.cpp's logits [len - 1, V] for tokens (llama-cpp-python run by `python` in a temp dir)."""
    import numpy as np
    import torch

    script = (
        "import json, sys, numpy as np, llama_cpp, llama_cpp.llama_cpp as C\n"
        "default = C.llama_model_default_params\n"
        "def plain():  # no extra buffer types (AMX, repacked weights), as bench launch: 0.3.36's AMX path\n"
        "    p = default()  # segfaults on the Sapphire Rapids VMs here\n"
        "    p.use_extra_bufts = False\n"
        "    return p\n"
        "C.llama_model_default_params = plain\n"
        "a = json.load(open(sys.argv[1]))\n"
        "m = llama_cpp.Llama(a['path'], n_ctx=len(a['tokens']) + 16, logits_all=True, verbose=False,\n"
        "                    n_threads=a['threads'] or None, n_batch=512)\n"
        "m.eval(a['tokens'][:-1])\n"
        "np.save(sys.argv[2], np.asarray(m.scores[:len(a['tokens']) - 1], dtype=np.float32))\n")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "args.json").write_text(json.dumps({"path": str(Path(path).resolve()), "tokens": tokens,
                                                       "threads": threads}))
        (Path(d) / "run.py").write_text(script)
        subprocess.run([python, "run.py", "args.json", "out.npy"], cwd=d, check=True)
        return torch.from_numpy(np.load(Path(d) / "out.npy"))


def measure(args: argparse.Namespace) -> dict:
    import torch

    from chatserve.config import CacheConfig, ModelConfig
    from chatserve.runtime.device import set_num_threads
    from chatserve.runtime.model_runner import ModelRunner

    threads = set_num_threads(args.threads)
    ref_model = hf_reference(args.model)
    vocab = ref_model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab, (args.prompt,), generator=g).tolist()
    tokens, ref = reference_run(ref_model, prompt, args.decode)
    del ref_model
    lc = llama_cpp_logits(args.llama_cpp_python, args.model, tokens, threads) if args.llama_cpp_python else None
    bs = 16
    blocks = args.batch * -(-len(tokens) // bs)
    rows = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        t0 = time.perf_counter()
        runner = ModelRunner(ModelConfig(model=args.model, dtype=dtype, num_threads=threads),
                             CacheConfig(block_size=bs, num_blocks=blocks), progress=False)
        load_s = time.perf_counter() - t0
        got = chatserve_logits(runner, [tokens] * args.batch, args.prompt)[0]
        row = asdict(compare(f"{dtype}, {runner.model.describe_backends()}", got, ref, args.prompt))
        row["load_s"] = round(load_s, 1)
        if lc is not None:              # chatserve against llama.cpp directly, every position
            row["llama_cpp_max_abs"] = float((got - lc).abs().max())
        rows.append(row)
        del runner
    report: dict = {"model": str(args.model), "prompt": args.prompt, "decode": args.decode,
                    "batch": args.batch, "threads": threads, "variants": rows}
    if lc is not None:
        report["llama_cpp"] = asdict(compare("llama.cpp (llama-cpp-python)", lc, ref, args.prompt))
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve bench quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="chatserve dtypes to run, comma-separated (empty: none)")
    p.add_argument("--prompt", type=int, default=64, help="random prompt tokens (prefill positions)")
    p.add_argument("--decode", type=int, default=64, help="greedy continuation tokens (decode positions)")
    p.add_argument("--batch", type=int, default=1, help="copies of the sequence decoded side by side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--llama-cpp-python", default=None,
                   help="a Python interpreter that imports llama_cpp: also report llama.cpp's logits")
    p.add_argument("--json", action="store_true")
    return p


def format_report(r: dict) -> str:
    lines = [f"{r['model']}: {r['prompt']} prompt + {r['decode']} decoded tokens, batch {r['batch']}, "
             f"{r['threads']} threads; against transformers float32 on the file's dequantized weights"]
    rows = r["variants"] + ([r["llama_cpp"]] if "llama_cpp" in r else [])
    for a in rows:
        lines.append(f"  {a['variant']}\n    top-1 prefill {100 * a['prefill_top1']:.1f} % "
                     f"decode {100 * a['decode_top1']:.1f} %; max |Δlogit| prefill {a['prefill_max_abs']:.4f} "
                     f"decode {a['decode_max_abs']:.4f} (max |logit| {a['logit_scale']:.2f})"
                     + (f"; vs llama.cpp {a['llama_cpp_max_abs']:.4f}" if "llama_cpp_max_abs" in a else "")
                     + (f"; loaded in {a['load_s']} s" if "load_s" in a else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
