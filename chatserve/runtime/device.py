"""Device and thread choices for the runtime: "auto" → CUDA when present, else CPU; torch threads.

Not a placement policy for tensors (each runtime module takes the device it is given).
"""
from __future__ import annotations

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
