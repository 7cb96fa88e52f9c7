"""Paged attention: Triton kernels (CPU interpreter) vs the torch twins, and the twins vs a dense oracle.

Grid: ragged context lengths (last block partly filled), block sizes 8/16/32, GQA ratios 1/2/3/4/8,
head dims 64/128, fp32/fp16/bf16 queries, plain/int8/fp8 caches, split-K counts, sliding windows.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from chatserve_kernels import paged_attention
from chatserve_kernels.decode_attention import decode_attention_triton
from chatserve_kernels.paged_attention import paged_attention_torch, paged_attention_triton
from kernel_cases import TOL_DENSE, assert_close, dense_reference, make_case, needs_interpreter

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (seq_lens, q_heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype, num_splits, window)
DECODE = [
    ([37, 5], 9, 3, 64, 16, F32, "auto", None, None),
    ([37, 5], 9, 3, 64, 16, F32, "auto", 3, None),
    ([70, 1, 33], 8, 1, 128, 8, F16, "auto", 2, None),
    ([100, 45], 4, 4, 64, 32, BF16, "auto", 4, None),
    ([17], 2, 1, 128, 16, F32, "auto", 1, None),
    ([50, 3, 29, 64], 16, 4, 64, 8, F16, "auto", None, None),
    ([31, 32, 33], 5, 5, 64, 16, F32, "auto", 2, None),
    ([48], 24, 3, 64, 16, F16, "auto", 1, None),
    ([40, 17], 6, 2, 64, 16, F32, "int8", 2, None),
    ([40, 17], 6, 2, 128, 32, F16, "int8", 1, None),
    ([40, 17], 6, 2, 64, 8, BF16, "int8", 3, None),
    ([40, 17], 6, 2, 64, 16, F16, "fp8", 2, None),
    ([33, 9], 8, 2, 128, 16, F32, "fp8", 1, None),
    ([40, 17], 6, 3, 64, 16, BF16, "fp8_per_tensor", 2, None),
    ([60, 17], 6, 2, 64, 16, F32, "auto", 3, 20),
    ([60, 17], 9, 3, 64, 8, F16, "int8", 2, 9),
]
# (query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype, window)
EXTEND = [
    ([5, 1, 20], [37, 9, 20], 9, 3, 64, 16, F32, "auto", None),
    ([17, 1], [30, 40], 8, 1, 128, 8, F16, "auto", None),
    ([3, 7], [50, 7], 4, 4, 64, 32, BF16, "auto", None),
    ([33], [33], 2, 1, 128, 16, F32, "auto", None),
    ([12, 1], [40, 17], 6, 2, 64, 16, F32, "int8", None),
    ([9, 4], [25, 4], 16, 2, 64, 8, F16, "int8", None),
    ([12, 1], [40, 17], 6, 2, 64, 16, F16, "fp8", 9),
    ([12, 1], [40, 17], 6, 3, 64, 16, BF16, "fp8_per_tensor", None),
    ([20], [45], 9, 3, 64, 32, F32, "auto", 16),
]


def _id(c) -> str:
    return "-".join(str(getattr(x, "__name__", x)).replace("torch.", "") for x in c if x is not None)


def decode_case(c, seed=0):
    seq_lens, hq, hkv, d, bs, dt, kvd, splits, window = c
    case = make_case([1] * len(seq_lens), seq_lens, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs,
                     dtype=dt, kv_cache_dtype=kvd, seed=seed)
    return case, dt, splits, window


def extend_case(c, seed=0):
    qls, sls, hq, hkv, d, bs, dt, kvd, window = c
    case = make_case(qls, sls, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt,
                     kv_cache_dtype=kvd, seed=seed)
    return case, dt, window


@needs_interpreter
@pytest.mark.parametrize("c", DECODE, ids=[_id(c) for c in DECODE])
def test_decode_triton_matches_twin(c):
    case, dt, splits, window = decode_case(c)
    got = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, num_splits=splits, **case.kwargs())
    want = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, **case.kwargs())
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    assert_close(got, want, dt)


@needs_interpreter
@pytest.mark.parametrize("c", EXTEND, ids=[_id(c) for c in EXTEND])
def test_extend_and_mixed_triton_match_twin(c):
    case, dt, window = extend_case(c)
    got = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, **case.kwargs())
    want = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window, **case.kwargs())
    assert_close(got, want, dt)


@pytest.mark.parametrize("c", DECODE, ids=[_id(c) for c in DECODE])
def test_decode_twin_matches_dense(c):
    case, dt, _, window = decode_case(c)
    got = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                sliding_window=window, **case.kwargs())
    assert_close(got, dense_reference(case, window), dt, TOL_DENSE)


@pytest.mark.parametrize("c", EXTEND, ids=[_id(c) for c in EXTEND])
def test_extend_twin_matches_dense(c):
    case, dt, window = extend_case(c)
    got = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                sliding_window=window, **case.kwargs())
    assert_close(got, dense_reference(case, window), dt, TOL_DENSE)


@needs_interpreter
def test_public_function_uses_triton_when_forced(force_triton, monkeypatch):
    # the forced path must actually launch the kernel: count launches through the launcher
    pa = importlib.import_module("chatserve_kernels.paged_attention")  # the attribute is the function
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
    da = importlib.import_module("chatserve_kernels.decode_attention")
    calls = []
    real = da.F.scaled_dot_product_attention
    monkeypatch.setattr(da.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = make_case([1] * 12, [5 + 3 * i for i in range(12)], q_heads=9, kv_heads=3, head_dim=64,
                     block_size=16, dtype=F32)
    paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert len(calls) == 1
