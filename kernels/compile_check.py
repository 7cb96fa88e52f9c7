"""Compile every kernel variant for a GPU target (default sm_90, H200) on a machine without a GPU.

`python -m chatserve_kernels.compile_check [--arch 90]` catches compiled-mode errors that the CPU
interpreter cannot see, and prints registers / spill stack / shared memory per variant. It does not
run anything. It needs TRITON_INTERPRET unset or 0, so it runs in its own process.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

from chatserve_kernels import env

# pointer tags used in _variants (scalars are spelled "i32" / "fp32" as triton spells them)
_PTR = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16", "i8": "*i8", "fp8": "*fp8e4nv", "pi32": "*i32",
        "pi64": "*i64"}
_ATTN_STRIDES = ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_ct", "stride_ch",
                 "stride_sb", "stride_st", "stride_sh", "stride_bt"]
_ALIGNED = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_ct", "stride_ch",
            "stride_kt", "stride_kh", "stride_vt", "stride_vh"}


def _attention_args(q: str, c: str, mode: int) -> dict:
    """The non-constexpr arg types the decode and extend kernels share (scales fp32 when quantized)."""
    s = "f32" if mode else c
    return dict(q_ptr=q, k_ptr=c, v_ptr=c, ks_ptr=s, vs_ptr=s, out_ptr=q, part_o_ptr="f32",
                part_lse_ptr="f32", block_tables_ptr="pi32", seq_lens_ptr="pi32", qsl_ptr="pi32",
                sm_scale_log2="fp32", window="i32", tokens_per_split="i32", num_splits="i32",
                **{n: "i32" for n in _ATTN_STRIDES})


def _variants(tl) -> list[tuple[str, str, dict, dict, int, int]]:
    """(label, kernel name, non-constexpr arg types, constexprs, num_warps, num_stages)."""
    from chatserve_kernels.extend_attention import extend_num_warps

    comp = {"f32": tl.float32, "f16": tl.float16, "bf16": tl.bfloat16}
    out = []
    # decode: (q dtype, cache dtype, scale mode, split, window, head_dim, block_n)
    for q, c, mode, split, win, d, bn in [
            ("f16", "f16", 0, False, False, 128, 64), ("bf16", "bf16", 0, True, False, 128, 64),
            ("bf16", "bf16", 0, True, True, 64, 128), ("f32", "f32", 0, True, False, 64, 32),
            ("f16", "i8", 1, True, False, 128, 64), ("bf16", "fp8", 1, False, False, 64, 128),
            ("bf16", "fp8", 2, True, False, 128, 64), ("f32", "i8", 1, True, True, 64, 32)]:
        args = _attention_args(q, c, mode)
        consts = dict(NUM_Q_HEADS=32, GROUP=4, GROUP_PAD=16, HEAD_DIM=d, D_PAD=d, BLOCK_SIZE=16, BLOCK_N=bn,
                      SCALE_MODE=mode, COMPUTE=comp[q], PRECISION="ieee" if q == "f32" else "tf32",
                      SPLIT=split, WINDOW=win)
        out.append((f"decode q={q} kv={c} scale={mode} split={split} window={win} d={d}",
                    "decode_attention._decode_kernel", args, consts, 4, 2))
    out.append(("merge d=128", "decode_attention._merge_kernel",
                dict(out_ptr="bf16", part_o_ptr="f32", part_lse_ptr="f32", qsl_ptr="pi32", num_splits="i32",
                     stride_ot="i32", stride_oh="i32"),
                dict(NUM_Q_HEADS=32, HEAD_DIM=128, D_PAD=128, S_PAD=64), 4, 2))
    # extend: (q dtype, cache dtype, scale mode, window, skip decode, head_dim, group_pad, block_m, split)
    for q, c, mode, win, skip, d, gp, bm, split in [
            ("bf16", "bf16", 0, False, True, 128, 4, 32, False), ("f16", "f16", 0, True, False, 64, 4, 16, False),
            ("f32", "f32", 0, False, False, 64, 4, 8, False), ("f32", "f32", 0, False, False, 128, 1, 32, False),
            ("bf16", "i8", 1, False, True, 128, 8, 16, False), ("f16", "fp8", 2, True, False, 64, 2, 64, False),
            ("bf16", "bf16", 0, False, True, 128, 4, 4, True), ("bf16", "i8", 1, True, True, 64, 8, 2, True),
            ("f32", "f32", 0, False, True, 64, 4, 4, True)]:
        args = _attention_args(q, c, mode)
        fp32 = q == "f32"
        consts = dict(NUM_Q_HEADS=32, GROUP=gp, GROUP_PAD=gp, BLOCK_M=bm, HEAD_DIM=d, D_PAD=d, BLOCK_SIZE=16,
                      BLOCK_N=32 if fp32 else 64, SCALE_MODE=mode, COMPUTE=comp[q],
                      PRECISION="ieee" if fp32 else "tf32", WINDOW=win, SKIP_DECODE=skip, SPLIT=split)
        out.append((f"extend q={q} kv={c} scale={mode} window={win} d={d} rows={gp * bm} split={split}",
                    "extend_attention._extend_kernel", args, consts, extend_num_warps(gp * bm, d, fp32),
                    1 if fp32 else 2))
    out.append(("extend merge d=128", "extend_attention._extend_merge_kernel",
                dict(out_ptr="bf16", part_o_ptr="f32", part_lse_ptr="f32", qsl_ptr="pi32", num_splits="i32",
                     stride_ot="i32", stride_oh="i32"),
                dict(NUM_Q_HEADS=32, HEAD_DIM=128, D_PAD=128, S_PAD=64, SKIP_DECODE=True), 4, 2))
    # store: (key dtype, cache dtype, scale mode)
    for k, c, mode in [("bf16", "bf16", 0), ("f32", "f16", 0), ("f16", "i8", 1), ("bf16", "fp8", 1),
                       ("f32", "fp8", 2)]:
        s = "f32" if mode else c
        args = dict(key_ptr=k, value_ptr=k, k_cache_ptr=c, v_cache_ptr=c, k_scale_ptr=s, v_scale_ptr=s,
                    slot_ptr="pi64", **{n: "i32" for n in ["stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                                          "stride_cb", "stride_ct", "stride_ch", "stride_sb",
                                                          "stride_st", "stride_sh"]})
        consts = dict(BLOCK_SIZE=16, HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, SCALE_MODE=mode,
                      IS_INT8=c == "i8", QMAX=127.0 if c == "i8" else 448.0)
        out.append((f"store key={k} kv={c} scale={mode}", "kv_store._store_kv_kernel", args, consts, 4, 1))
    out.append(("copy", "block_copy._copy_blocks_kernel", dict(table_ptr="pi64", mapping_ptr="pi64"),
                dict(NUM_BUFS=60, CHUNK=1024), 4, 1))
    return out


def _resources(triton, cubin: bytes) -> tuple[int, int] | None:
    """(registers, stack bytes) of a cubin, from the cuobjdump shipped with triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", text, re.S)
    return (int(m.group(1)), int(m.group(2))) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chatserve_kernels.compile_check", description=__doc__)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10 (90 = H100/H200)")
    args = p.parse_args(argv)
    if env.triton_interpret() not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (it must not be 1)", file=sys.stderr)
        return 2
    env.set_triton_interpret("0")             # keep dispatch.py from choosing the interpreter
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failed = spilled = 0
    for label, where, types, consts, warps, stages in _variants(tl):
        mod, _, name = where.rpartition(".")
        kernel = getattr(importlib.import_module(f"chatserve_kernels.{mod}"), name)
        sig, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in consts:
                sig[arg] = "constexpr"
                continue
            t = types[arg]
            sig[arg] = _PTR.get(t, t)
            if sig[arg].startswith("*") or arg in _ALIGNED:   # as the JIT specializes at launch
                attrs[(i,)] = [["tt.divisibility", 16]]
        try:
            k = triton.compile(ASTSource(kernel, sig, constexprs=dict(consts), attrs=attrs), target=target,
                               options={"num_warps": warps, "num_stages": stages})
        except Exception as e:  # noqa: BLE001 - report every variant
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        res = _resources(triton, k.asm["cubin"])
        regs, stack = res if res else ("?", 0)
        spilled += int(stack > 64)
        print(f"ok   {label:55s} regs={regs} stack={stack}B smem={k.metadata.shared}B "
              f"warps={warps} stages={stages}")
    print(f"sm_{args.arch}: {failed} failed, {spilled} with >64 B of spill stack")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
