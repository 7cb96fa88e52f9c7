"""zero_pages.zeros against torch.zeros (its oracle): same shape, dtype and exact zeros; the map lives as long
as any view; untouched pages are not resident; and the KV caches built on it (every kv_cache_dtype)."""
from __future__ import annotations

import gc

import pytest
import torch

from chatserve.runtime.arch_config import ArchConfig
from chatserve.runtime.kv_cache import allocate_kv_caches
from chatserve_kernels import allocate_kv_cache
from chatserve_kernels.quant import FP8
from chatserve_kernels.zero_pages import zeros

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, FP8]


def _resident_bytes() -> int:
    """This process's resident set (Linux /proc: pages, times the page size)."""
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 16, 3, 64), (5, 16, 3), (1,), (0, 4)])
def test_zeros_matches_torch_zeros(shape, dtype):
    got, want = zeros(shape, dtype), torch.zeros(shape, dtype=dtype)
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    assert got.is_contiguous() and got.stride() == want.stride()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))   # bit-exact: +0.0, not -0.0


def test_map_outlives_the_name_and_keeps_writes():
    t = zeros((64, 1024), torch.float32)
    t[3, 5] = 2.5
    row = t[3]            # a view: it alone must keep the map alive
    del t
    gc.collect()
    _ = [torch.ones(1 << 20) for _ in range(4)]    # reuse freed memory if the map had been unmapped
    assert row[5].item() == 2.5 and float(row.sum()) == 2.5


def test_untouched_pages_are_not_resident():
    before = _resident_bytes()
    t = zeros((256, 1 << 20), torch.uint8)        # 256 MiB
    assert _resident_bytes() - before < (32 << 20)
    t[0].fill_(1)         # first touch: now that page (or huge page) is resident, and holds the write
    assert int(t[0].sum()) == 1 << 20 and int(t[1].sum()) == 0


@pytest.mark.parametrize("kvd", ["auto", "float16", "int8", "fp8", "fp8_per_tensor"])
def test_allocate_kv_cache_zeros_as_before(kvd):
    k, v, ks, vs = allocate_kv_cache(6, 16, 3, 64, torch.float32, kvd)
    for t in (k, v):
        assert t.shape == (6, 16, 3, 64) and not bool(t.view(torch.uint8).any())
    if kvd in ("int8", "fp8"):
        assert ks is not None and vs is not None
        assert ks.shape == (6, 16, 3) and ks.dtype == torch.float32 and not bool(ks.any())
    elif kvd == "fp8_per_tensor":
        assert ks is not None and ks.tolist() == [1.0]
    else:
        assert ks is None and vs is None


def test_allocate_kv_caches_are_zero_and_independent():
    cfg = ArchConfig(arch="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    caches = allocate_kv_caches(cfg, 16, torch.float32, num_blocks=5)
    assert len(caches) == 3
    caches[0][0][2, 3] = 1.0
    for layer, pair in enumerate(caches):
        for i, t in enumerate(pair):
            assert t.shape == (5, 16, 2, 16) and t.dtype == torch.float32
            assert float(t.abs().sum()) == (32.0 if (layer, i) == (0, 0) else 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_keeps_torch_zeros():
    t = zeros((4, 8), torch.float16, "cuda")
    assert t.device.type == "cuda" and not bool(t.any())
