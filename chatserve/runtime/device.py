"""Device, dtype and thread choices for the runtime: "auto" → CUDA when present, else CPU; "auto" dtype
→ bf16 where the hardware computes in it; torch threads.

Not a placement policy for tensors (each runtime module takes the device it is given).
"""
from __future__ import annotations

import functools
import os

import torch


def resolve_device(name: str | torch.device | None) -> torch.device:
    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_num_threads(num_threads: int | None) -> int:
    """torch intra-op threads: the given count, else every core this process may run on."""
    n = int(num_threads) if num_threads else available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """The CPU has bf16 dot instructions (AVX512-BF16 or AMX) that oneDNN's GEMMs use."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    except OSError:
        return False
    mkldnn: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # unannotated in torch
    return mkldnn and bool({"avx512_bf16", "amx_bf16"} & set(flags))


def resolve_dtype(name: str, device: torch.device) -> str:
    """"auto" → bfloat16 on CUDA and on CPUs with bf16 instructions, else float32.

    On such a CPU prepacked bf16 GEMMs use the bf16 dot instructions (faster than fp32 through MKL;
    figures in docs/benchmarks.md) and the KV cache takes half the bytes; elsewhere oneDNN would emulate bf16,
    slower than fp32. `--dtype float32` overrides it.
    """
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"
