"""The attention warm-up (chatserve_kernels.triton_warm_up) through the interpreter: every variant it
means to compile is launched, none that needs more blocks than the cache has, and the cache is only read.
That it leaves nothing to compile for real steps is checked on a GPU (test_cuda.py)."""
from __future__ import annotations

import torch

from chatserve_kernels.dispatch import merge_pad
from chatserve_kernels.quant import allocate_kv_cache
from chatserve_kernels.extend_attention import extend_tiles
from chatserve_kernels.triton_warm_up import warm_up_attention
from kernel_cases import needs_interpreter


def test_extend_tiles_halve_down_to_sixteen_rows():
    assert extend_tiles(32, 4) == [32, 16, 8, 4]
    assert extend_tiles(16, 2) == [16, 8]
    assert extend_tiles(16, 1) == [16]


def test_merge_pad_has_three_widths():
    assert [merge_pad(s) for s in (2, 4, 5, 16, 17, 64)] == [4, 4, 16, 16, 64, 64]


@needs_interpreter
def test_warm_up_launches_each_variant_that_fits(force_triton):
    cache = allocate_kv_cache(10, 16, 2, 32, torch.float32, "int8", "cpu")   # 160 tokens
    for t in cache:
        t.view(torch.uint8).copy_(torch.randint(0, 100, t.view(torch.uint8).shape, dtype=torch.uint8))
    before = [t.clone() for t in cache]
    # decode (CPU tiles of 32 keys): 1, 2, 5 splits fit in 160 tokens, 17 do not → 3 launches; extend:
    # tiles 16 and 8 rows of a 2-head group × the same 3 splits × skip_decode off/on → 12
    assert warm_up_attention(cache, 4, torch.float32, [None]) == 15
    assert warm_up_attention(cache, 4, torch.float32, [None, 48, None]) == 30
    assert all(torch.equal(a, b) for a, b in zip(cache, before))
