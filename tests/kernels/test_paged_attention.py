"""Paged attention: Triton kernels (CPU interpreter) vs the torch twins, and the twins vs a dense oracle.

Grid: ragged context lengths (last block partly filled), block sizes 8/16/32, GQA ratios 1/2/3/4/8,
head dims 64/128, fp32/fp16/bf16 queries, plain/int8/fp8 caches, split-K counts, sliding windows.
"""
from __future__ import annotations

import pytest
import torch

from chatserve_kernels import attention as pa
from chatserve_kernels import decode_attention as da
from chatserve_kernels import extend_attention as ea
from chatserve_kernels import paged_attention
from chatserve_kernels.attention import paged_attention_torch, paged_attention_triton
from chatserve_kernels.decode_attention import decode_attention_triton
from kernel_cases import (DECODE, EXTEND, F32, TOL_DENSE, assert_close, case_id, decode_case,
                          dense_reference, extend_case, make_case, needs_interpreter)

@needs_interpreter
@pytest.mark.parametrize("c", DECODE, ids=[case_id(c) for c in DECODE])
def test_decode_triton_matches_twin(c):
    case, dt, splits, window = decode_case(c)
    got = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, num_splits=splits, **case.kwargs())
    want = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, **case.kwargs())
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    assert_close(got, want, dt)


@needs_interpreter
@pytest.mark.parametrize("c", EXTEND, ids=[case_id(c) for c in EXTEND])
def test_extend_and_mixed_triton_match_twin(c):
    case, dt, window = extend_case(c)
    got = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, **case.kwargs())
    want = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, **case.kwargs())
    assert_close(got, want, dt)


@pytest.mark.parametrize("c", DECODE, ids=[case_id(c) for c in DECODE])
def test_decode_twin_matches_dense(c):
    case, dt, _, window = decode_case(c)
    got = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                sliding_window=window, **case.kwargs())
    assert_close(got, dense_reference(case, window), dt, TOL_DENSE)


@pytest.mark.parametrize("c", EXTEND, ids=[case_id(c) for c in EXTEND])
def test_extend_twin_matches_dense(c):
    case, dt, window = extend_case(c)
    got = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                sliding_window=window, **case.kwargs())
    assert_close(got, dense_reference(case, window), dt, TOL_DENSE)


@needs_interpreter
def test_public_function_uses_triton_when_forced(force_triton, monkeypatch):
    # the forced path must actually launch the kernel: count launches through the launcher
    calls = []
    real = pa.decode_attention_triton
    monkeypatch.setattr(pa, "decode_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    case, dt, _, _ = decode_case(DECODE[0])
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [1]
    assert_close(got, dense_reference(case), dt, TOL_DENSE)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_decode_kernel_leaves_non_decode_rows_untouched(splits):
    # in a mixed batch the decode kernel writes only the rows of 1-token sequences
    case, _, _ = extend_case(EXTEND[0])
    out = torch.full_like(case.q, 7.0)
    m = case.meta
    decode_attention_triton(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                            m.query_start_loc, m.max_seq_len, case.scale, out, num_splits=splits)
    want = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    row = m.query_lens[0]                       # seq 1 is the decode row
    assert_close(out[row:row + 1], want[row:row + 1], torch.float32)
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[row] = False
    assert bool((out[others] == 7.0).all())


@pytest.mark.parametrize("kvd,bound", [("int8", 0.015), ("fp8", 0.05), ("fp8_per_tensor", 0.06)])
def test_quantized_cache_error_is_small(kvd, bound):
    # same K/V values stored unquantized and quantized: attention output moves by a bounded amount
    c = ([5, 1, 40], [60, 33, 40], 9, 3, 64, 16)
    ref = make_case(*c[:2], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=F32, seed=3)
    qc = make_case(*c[:2], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=F32,
                   kv_cache_dtype=kvd, seed=3)
    want = paged_attention_torch(ref.q, ref.k_cache, ref.v_cache, ref.meta, ref.scale)
    got = paged_attention_torch(qc.q, qc.k_cache, qc.v_cache, qc.meta, qc.scale, **qc.kwargs())
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < bound, rel
    assert rel > 0  # it really was quantized


def test_twin_decode_has_no_per_sequence_python_loop(monkeypatch):
    # the CPU serving path: a decode batch is one SDPA call, whatever the batch size
    calls = []
    real = da.F.scaled_dot_product_attention
    monkeypatch.setattr(da.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    case = make_case([1] * 12, [5 + 3 * i for i in range(12)], q_heads=9, kv_heads=3, head_dim=64,
                     block_size=16, dtype=F32)
    paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert len(calls) == 1


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dt", [F32, torch.bfloat16])
def test_twin_batches_short_chunks_in_one_set_of_ops(dt, window, monkeypatch):
    # prefix-cache hits and chat turns: several short chunks (and a long one, and decode rows) in a step
    calls = {"batch": 0, "single": 0}
    real_batch, real_single = ea.extend_batch_torch, ea.extend_attention_torch
    monkeypatch.setattr(pa, "extend_batch_torch",
                        lambda *a, **k: calls.__setitem__("batch", calls["batch"] + 1) or real_batch(*a, **k))
    monkeypatch.setattr(pa, "extend_attention_torch",
                        lambda *a, **k: calls.__setitem__("single", calls["single"] + 1) or real_single(*a, **k))
    case = make_case([16, 1, 3, 70, 9, 1], [50, 12, 3, 90, 41, 30], q_heads=9, kv_heads=3, head_dim=64,
                     block_size=16, dtype=dt)
    got = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                sliding_window=window)
    assert calls == {"batch": 1, "single": 1}          # 16, 3 and 9 together; the 70-token chunk alone
    assert_close(got, dense_reference(case, window), dt, TOL_DENSE)


# (query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size, kv_cache_dtype, window, num_splits)
EXTEND_SPLITS = [
    ([5, 1, 20], [137, 90, 20], 9, 3, 64, 16, "auto", None, 3),   # split boundaries mid-block, a decode row
    ([4], [300], 8, 2, 64, 8, "int8", None, 4),
    ([6, 3], [200, 71], 6, 2, 64, 16, "auto", 40, 5),              # a window: some splits see nothing
]


@needs_interpreter
@pytest.mark.parametrize("c", EXTEND_SPLITS, ids=[f"q{c[0]}-s{c[1]}-{c[6]}-w{c[7]}-x{c[8]}" for c in EXTEND_SPLITS])
def test_extend_split_k_triton_matches_twin(c):
    # short chunks over long prefixes: the keys cut into splits, merged by log-sum-exp
    qls, sls, hq, hkv, d, bs, kvd, window, splits = c
    case = make_case(qls, sls, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=F32,
                     kv_cache_dtype=kvd)
    m = case.meta
    out = torch.full_like(case.q, 7.0)
    ea.extend_attention_triton(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                               m.query_start_loc, m.max_query_len, case.scale, out, **case.kwargs(),
                               sliding_window=window, skip_decode=True, num_splits=splits,
                               max_seq_len=m.max_seq_len)
    want = paged_attention_torch(case.q, case.k_cache, case.v_cache, m, case.scale, sliding_window=window,
                                 **case.kwargs())
    rows = torch.cat([torch.arange(s, s + ql) for s, ql in zip(m.query_start_loc.tolist(), qls) if ql > 1])
    assert_close(out[rows], want[rows], F32)
    decode_rows = [s for s, ql in zip(m.query_start_loc.tolist(), qls) if ql == 1]
    assert bool((out[decode_rows] == 7.0).all())                   # decode rows left alone
    assert ea.choose_extend_splits(3, 16384, 16, torch.device("cpu")) > 1
    assert ea.choose_extend_splits(3, 16384, 4000, torch.device("cpu")) == 1
