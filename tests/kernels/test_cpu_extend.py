"""Prefill chunks through torch's CPU flash kernel (kernels/cpu_extend.py) against the dense oracle.

Lengths cross cache blocks, the flash kernel's query and key tiles (64/256 and 512) and the short-chunk
batch limit (64); prefixes end mid-block; GQA 1-8, head dims 32-128, fp32/bf16, an int8 cache, mixed
steps with decode rows; soft-capping and per-layer windows through the twin.
"""
from __future__ import annotations

import pytest

from chatserve_kernels import attention as pa
from chatserve_kernels import extend_attention as ea
from chatserve_kernels import paged_attention
from chatserve_kernels import step_plan as sp
from chatserve_kernels.attention import paged_attention_torch
from chatserve_kernels.cpu_extend import flash_supported
from chatserve_kernels.step_plan import PlanKey
from kernel_cases import BF16, F32, TOL_DENSE, assert_close, dense_reference, make_case

# (query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size, dtype)
GRID = [
    ([7], [7], 9, 3, 64, 16, F32),
    ([40], [57], 9, 3, 64, 16, F32),               # prefix of 17: ends mid-block
    ([65], [65], 9, 3, 64, 16, BF16),              # just past the short-chunk batch limit
    ([300], [300], 8, 1, 128, 8, F32),             # fresh, several query tiles
    ([200], [1000], 4, 4, 32, 32, BF16),           # prefix of 800 crosses the 512-key tile
    ([513], [1300], 9, 3, 64, 16, F32),            # chunk crosses 512, prefix 787 ends mid-block
    ([513], [1300], 9, 3, 64, 16, BF16),
    ([33, 100, 1], [33, 611, 90], 6, 2, 64, 16, F32),   # two chunks and a decode row
    ([70, 1, 2], [581, 20, 2], 16, 2, 64, 8, BF16),
]


def _id(c) -> str:
    qls, sls, hq, hkv, d, bs, dt = c
    return f"q{'+'.join(map(str, qls))}-s{max(sls)}-h{hq}/{hkv}-d{d}-bs{bs}-{str(dt)[6:]}"


@pytest.mark.parametrize("c", GRID, ids=[_id(c) for c in GRID])
def test_flash_prefill_matches_dense(c):
    qls, sls, hq, hkv, d, bs, dt = c
    case = make_case(qls, sls, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt, seed=len(sls))
    assert flash_supported(case.q)
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert got.dtype == dt and got.shape == case.q.shape
    assert_close(got, dense_reference(case), dt, TOL_DENSE)


def test_flash_prefill_on_an_int8_cache():
    case = make_case([90], [400], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=F32,
                     kv_cache_dtype="int8")
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, **case.kwargs())
    assert_close(got, dense_reference(case), F32, TOL_DENSE)


def test_flash_path_builds_no_chunk_by_context_tensor(monkeypatch):
    # the twin's causal bias [ql, sl] and its score matrix are never built for a long chunk
    def boom(*a, **k):
        raise AssertionError("chunk x context tensor built")
    monkeypatch.setattr(sp, "extend_prep", boom)
    monkeypatch.setattr(pa, "extend_attention_torch", boom)
    case = make_case([300, 1], [700, 40], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=F32)
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(got, dense_reference(case), F32, TOL_DENSE)
    monkeypatch.setattr(sp, "extend_prep", ea.extend_prep)         # the twin still builds it
    monkeypatch.setattr(pa, "extend_attention_torch", ea.extend_attention_torch)
    assert_close(paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale),
                 dense_reference(case), F32, TOL_DENSE)


@pytest.mark.parametrize("dt", [F32, BF16])
def test_softcap_and_per_layer_windows(dt):
    # Gemma-style layers: soft-capped scores, alternating windowed and global layers (the C kernel
    # takes both: no per-step plan is built; the twin, with its plans, gets the same answers)
    case = make_case([1, 40, 5, 1], [30, 57, 21, 70], q_heads=8, kv_heads=2, head_dim=64, block_size=16,
                     dtype=dt)
    assert not flash_supported(case.q, sliding_window=16) and not flash_supported(case.q, logit_softcap=50.0)
    case.q.mul_(4.0)                                      # large scores, so the cap matters
    for window in (16, None, 16):
        got = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                              sliding_window=window, logit_softcap=5.0)
        assert_close(got, dense_reference(case, window, logit_softcap=5.0), dt, TOL_DENSE)
    plain = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert (plain - got).abs().max() > 0.1               # the cap and the window changed the result
    assert not case.meta.plans
    for window in (16, None, 16):
        twin = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                     sliding_window=window, logit_softcap=5.0)
        assert_close(twin, dense_reference(case, window, logit_softcap=5.0), dt, TOL_DENSE)
    assert set(case.meta.plans) == {PlanKey(16, 16, True), PlanKey(16, 0, True)}


def test_metadata_caches_slot_validity():
    case = make_case([3], [3], q_heads=2, kv_heads=1, head_dim=32, block_size=16, dtype=F32)
    assert case.meta.all_slots_valid
    case.meta.slot_mapping[1] = -1
    assert case.meta.all_slots_valid                      # computed once per step
    case2 = make_case([3], [3], q_heads=2, kv_heads=1, head_dim=32, block_size=16, dtype=F32)
    case2.meta.slot_mapping[1] = -1
    assert not case2.meta.all_slots_valid
