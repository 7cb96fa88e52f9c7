"""`zeros`: a zero-filled tensor that, on the CPU, costs no time up front: its bytes are an anonymous
memory map, whose pages the OS hands out already zeroed when they are first touched.

Why: `torch.zeros` writes every byte at once; for a 2 GiB KV cache that is seconds of a server's start, and
the whole cache resident before a single block is used. Here a page becomes resident (and costs its
zeroing) when a block in it is first written or read. Not an allocator: one map per tensor, freed with it.
"""
from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A contiguous tensor of `shape` and `dtype`, every element exactly zero (as torch.zeros gives).

    CPU: over a private anonymous mmap in plain pages; other devices: torch.zeros. The tensor's storage holds
    the buffer export that keeps the map alive for as long as any view of it exists. Not madvise(
    MADV_HUGEPAGE): on the AVX2 test box (a VM, THP "madvise") it made the warm-up's first touch of 60 maps
    ~1 s slower (1.55-2.62 s vs 0.69-0.98 s, 3 pairs), and a touched block would pin 2 MiB, not 4 KiB."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # frombuffer keeps a buffer export of `buf` inside the storage: the map lives until the storage dies
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
