"""KV store and block copy: Triton (CPU interpreter) vs twin, bit for bit, plus the quantizers' contract."""
from __future__ import annotations

import pytest
import torch

from chatserve_kernels import allocate_kv_cache, copy_blocks, kv_bytes_per_token, store_kv
from chatserve_kernels.block_copy import copy_blocks_torch, copy_blocks_triton
from chatserve_kernels.dispatch import interpreting
from chatserve_kernels.kv_store import store_kv_torch, store_kv_triton
from chatserve_kernels.quant import FP8_MAX, dequantize_torch, quantize_torch
from kernel_cases import STORE, case_id, needs_interpreter, store_inputs

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8)


@needs_interpreter
@pytest.mark.parametrize("c", STORE, ids=[case_id(c) for c in STORE])
def test_store_triton_is_bit_exact_with_twin(c):
    T, H, D, nb, bs, dt, kvd = c
    key, val, slots = store_inputs(T, H, D, nb, bs, dt, seed=T)
    a = allocate_kv_cache(nb, bs, H, D, dt, kvd)
    b = allocate_kv_cache(nb, bs, H, D, dt, kvd)
    store_kv_triton(key, val, a[0], a[1], slots, a[2], a[3])
    store_kv_torch(key, val, b[0], b[1], slots, b[2], b[3])
    for x, y in zip(a, b):
        if x is not None:
            assert torch.equal(_bits(x), _bits(y))
    # the skipped token wrote nothing: every slot outside slot_mapping is still zero
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for cache in (a[0], a[1]):
        assert not bool(cache.view(torch.uint8).view(nb * bs, -1)[untouched].any())


@pytest.mark.parametrize("kvd", ["int8", "fp8"])
def test_store_twin_round_trips_within_quantization_step(kvd):
    key, val, slots = store_inputs(8, 3, 64, 4, 16, F32, seed=1)
    k, v, ks, vs = allocate_kv_cache(4, 16, 3, 64, F32, kvd)
    store_kv(key, val, k, v, slots, k_scale=ks, v_scale=vs)
    keep = slots >= 0
    got = dequantize_torch(k.view(64, 3, 64)[slots[keep]], ks.view(64, 3)[slots[keep]], F32)
    amax = key[keep].abs().amax(-1, keepdim=True)
    # int8: half a step of amax/127; e4m3: 2^-4 relative (3 mantissa bits), both per (token, head)
    err = (got - key[keep]).abs()
    bound = amax / 127 * 0.5 + 1e-6 if kvd == "int8" else key[keep].abs() / 16 + amax / FP8_MAX * 2 ** -6
    assert bool((err <= bound).all())


def test_quantize_saturates_and_rounds_half_away_from_zero():
    x = torch.tensor([[[2.5, -2.5, 127.0, -127.0, 0.49]]])
    codes, s = quantize_torch(x, torch.int8)
    assert s.item() == 1.0
    assert codes.tolist() == [[[3, -3, 127, -127, 0]]]
    big = torch.tensor([[[1000.0, -1000.0, 1.0]]])
    c8, none = quantize_torch(big, torch.float8_e4m3fn, torch.tensor([1.0]))
    assert none is None and c8.float().tolist() == [[[448.0, -448.0, 1.0]]]


def test_allocate_and_bytes_per_token():
    k, v, ks, vs = allocate_kv_cache(5, 16, 3, 64, F16, "int8")
    assert k.dtype == torch.int8 and k.shape == (5, 16, 3, 64) and ks.shape == (5, 16, 3)
    k, v, ks, vs = allocate_kv_cache(5, 16, 3, 64, F16, "fp8_per_tensor")
    assert k.dtype == torch.float8_e4m3fn and ks.shape == (1,) and ks.item() == 1.0
    k, v, ks, vs = allocate_kv_cache(5, 16, 3, 64, BF16, "auto")
    assert k.dtype == BF16 and ks is None and vs is None
    # the default model: 3 kv heads × 64 dims; int8 with per-token scales is ~0.53× fp16
    assert kv_bytes_per_token(3, 64, F16) == 768
    assert kv_bytes_per_token(3, 64, F16, "int8") == 2 * (192 + 12)
    with pytest.raises(ValueError):
        allocate_kv_cache(1, 16, 1, 64, F32, "int4")


def _layers(L, nb, bs, H, D, kvd, seed):
    g = torch.Generator().manual_seed(seed)
    caches = [allocate_kv_cache(nb, bs, H, D, F16, kvd) for _ in range(L)]
    for k, v, ks, vs in caches:
        for t in (k, v, ks, vs):
            if t is not None and t.dim() > 1:
                t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, generator=g,
                                                        dtype=torch.uint8))
    return caches


@pytest.mark.parametrize("kvd", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_copy_blocks_all_layers_one_call(kvd, backend, monkeypatch):
    if backend == "triton":
        if not interpreting():
            pytest.skip("needs triton's CPU interpreter")
        monkeypatch.setenv("CHATSERVE_FORCE_TRITON", "1")
    L, nb, bs, H, D = 3, 6, 8, 2, 64
    caches = _layers(L, nb, bs, H, D, kvd, seed=5)
    before = [[t.clone() if t is not None else None for t in c] for c in caches]
    mapping = torch.tensor([[0, 3], [2, 5], [1, 4]])
    copy_blocks([c[0] for c in caches], [c[1] for c in caches], mapping,
                k_scales=[c[2] for c in caches], v_scales=[c[3] for c in caches])
    for now, old in zip(caches, before):
        for t, o in zip(now, old):
            if t is None:
                continue
            exp = o.view(torch.uint8).clone()
            for src, dst in mapping.tolist():
                exp[dst] = o.view(torch.uint8)[src]
            assert torch.equal(t.view(torch.uint8), exp)


@needs_interpreter
def test_copy_blocks_triton_matches_twin_on_mixed_buffers():
    # one launch over buffers of different dtypes and block sizes (caches and their scales)
    a = _layers(2, 5, 16, 3, 64, "int8", seed=9)
    b = [[t.clone() if t is not None else None for t in c] for c in a]
    mapping = torch.tensor([[4, 0], [1, 2]])
    copy_blocks_triton([t for c in a for t in c], mapping)
    copy_blocks_torch([t for c in b for t in c], mapping)
    for x, y in zip([t for c in a for t in c], [t for c in b for t in c]):
        assert torch.equal(x, y)
