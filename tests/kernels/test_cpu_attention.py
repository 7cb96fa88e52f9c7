"""The C paged-attention kernel (kernels/cpu_attention.c) against the torch twin and the dense oracle,
and its batch invariance: a row's bits whatever shares its call, however its prompt was chunked.

Grid: fp32/bf16, block sizes 8/16/32, GQA ratios 1-8, head dims 32-128, ragged lengths, sliding
windows, long contexts split across threads, decode rows mixed with prefill chunks, 1 and 2 threads.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chatserve_kernels import cpu_attention, cpu_build, paged_attention
from chatserve_kernels.attention import paged_attention_torch
from kernel_cases import BF16, F32, TOL_DENSE, assert_close, dense_reference, make_case

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason=str(cpu_build.status("cpu_attention")))

# (query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size, dtype, window)
GRID = [
    ([1], [1], 9, 3, 64, 16, F32, None),
    ([1, 1], [37, 5], 9, 3, 64, 16, F32, None),
    ([1, 1], [37, 5], 9, 3, 64, 16, BF16, None),
    ([1] * 3, [70, 1, 33], 8, 1, 128, 8, F32, None),
    ([1] * 3, [70, 1, 33], 8, 1, 128, 8, BF16, None),
    ([1, 1], [100, 45], 4, 4, 64, 32, BF16, None),
    ([1, 1], [100, 45], 4, 4, 64, 32, F32, None),
    ([1] * 4, [50, 3, 29, 64], 16, 4, 64, 8, F32, None),
    ([1] * 3, [31, 32, 33], 5, 5, 32, 16, BF16, None),
    ([1], [48], 24, 3, 64, 16, F32, None),
    ([1], [300], 6, 1, 32, 16, BF16, None),
    ([1, 1], [60, 17], 6, 2, 64, 16, F32, 20),
    ([1, 1], [60, 17], 9, 3, 64, 8, BF16, 9),
    ([1, 1], [60, 17], 9, 3, 64, 8, F32, 1),
    ([1] * 16, [5 + 17 * i for i in range(16)], 9, 3, 64, 16, BF16, None),
    ([1] * 16, [5 + 17 * i for i in range(16)], 9, 3, 64, 16, F32, None),
    # mixed batches: decode rows and prefill chunks in one call
    ([5, 1, 20], [37, 9, 20], 9, 3, 64, 16, F32, None),
    ([5, 1, 20], [37, 9, 20], 9, 3, 64, 16, BF16, None),
    ([1, 33, 1], [40, 33, 16], 8, 2, 128, 32, F32, None),
    ([12, 1], [40, 17], 6, 2, 64, 16, BF16, 9),
    # long contexts: at 2 threads split across threads (split-K, blocks never shared) and merged
    ([1], [1500], 9, 3, 64, 16, F32, None),
    ([1, 1], [1100, 40], 8, 2, 64, 16, BF16, None),
    ([1], [900], 9, 3, 64, 16, F32, 300),
    ([1, 1, 1], [700, 1, 2001], 6, 1, 32, 8, F32, None),
    ([1, 30, 1], [1037, 30, 530], 9, 3, 64, 16, BF16, 257),
    # long prefill chunks over a cached prefix, with and without a window
    ([300], [700], 9, 3, 64, 16, BF16, None),
    ([40, 1], [600, 300], 6, 2, 64, 16, F32, 100),
]


def _id(c) -> str:
    qls, sls, hq, hkv, d, bs, dt, w = c
    return f"q{len(qls)}x{max(qls)}-s{max(sls)}-h{hq}/{hkv}-d{d}-bs{bs}-{str(dt)[6:]}" + (f"-w{w}" if w else "")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c", GRID, ids=[_id(c) for c in GRID])
def test_kernel_matches_twin_and_dense(c, threads):
    qls, sls, hq, hkv, d, bs, dt, window = c
    case = make_case(qls, sls, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                    sliding_window=window, cpu_decode=True)
    finally:
        torch.set_num_threads(before)
    case.meta.plans.clear()
    twin = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                 sliding_window=window)
    assert got.dtype == dt and got.shape == case.q.shape
    # fp32: summation order only; bf16: the twin attends in bf16 (SDPA), the kernel in fp32
    tol = {F32: (2e-5, 2e-5), BF16: (3e-2, 3e-2)}
    assert_close(got, twin, dt, tol)
    assert_close(got, dense_reference(case, window), dt, TOL_DENSE)


@needs_kernel
def test_kernel_writes_every_row():
    case = make_case([4, 1, 6], [20, 9, 6], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=F32)
    out = torch.full_like(case.q, 7.0)
    assert cpu_attention.paged_attention_cpu(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out)
    assert not bool((out == 7.0).any(-1).any())
    assert_close(out, dense_reference(case), F32, TOL_DENSE)


@needs_kernel
def test_public_cpu_path_uses_the_kernel(monkeypatch):
    calls = []
    real = cpu_attention.paged_attention_cpu
    monkeypatch.setattr(cpu_attention, "paged_attention_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = make_case([1, 5], [30, 12], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=BF16)
    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [1]
    assert_close(out, dense_reference(case), BF16, TOL_DENSE)


@needs_kernel
@pytest.mark.parametrize("dt", [F32, BF16])
def test_soft_capped_scores_match_the_twin(dt):
    case = make_case([3, 1], [40, 21], q_heads=8, kv_heads=4, head_dim=64, block_size=16, dtype=dt)
    out = torch.empty_like(case.q)
    assert cpu_attention.paged_attention_cpu(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out,
                                             logit_softcap=3.0)
    twin = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, logit_softcap=3.0)
    plain = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, twin, dt, {F32: (2e-5, 2e-5), BF16: (3e-2, 3e-2)})
    assert not torch.allclose(out.float(), plain.float(), atol=1e-3)       # the cap changed something


def _rows(case, query_lens, seq_lens, tables, rows_q, threads=2, fn=None):
    """Attend query rows rows_q (taken from case.q) as sequences (query_lens, seq_lens) over case's cache
    (fn: a build of the kernel, e.g. avx2_paged_attention(); default the native one)."""
    from chatserve_kernels import AttentionMetadata
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, case.k_cache.shape[1], "cpu")
    q = rows_q.contiguous()
    out = torch.empty_like(q)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if fn is None:
            assert cpu_attention.paged_attention_cpu(q, case.k_cache, case.v_cache, meta, case.scale, out)
        else:
            assert cpu_attention.run(fn, q, case.k_cache, case.v_cache, meta, case.scale, out, None, None)
    finally:
        torch.set_num_threads(before)
    return out


@needs_kernel
@pytest.mark.parametrize("dt", [F32, BF16])
def test_rows_are_batch_and_chunk_invariant(dt):
    """One sequence's 700 prompt rows and its decode row: the same bits attended as one chunk, as
    chunks of 1/16/300 rows, beside other sequences of any length, at 1 and 2 threads (the native build:
    on an AVX-512 CPU the AVX-512 body, whose prompt rows pass over the keys in groups of up to 16, on an
    AVX2 CPU the AVX2 body's groups; test_avx2_body_matches_the_twin_and_is_batch_invariant covers the
    AVX2 body on AVX-512 CPUs too)."""
    L = 700
    case = make_case([L, 1, 1], [L, 1200, 33], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dt)
    table, others = case.tables[0], case.tables[1:]
    q = case.q[:L]
    whole = _rows(case, [L], [L], [table], q)
    for threads in (1, 2):
        assert torch.equal(_rows(case, [L], [L], [table], q, threads), whole)
    for chunk in (1, 16, 300):
        got = torch.cat([_rows(case, [min(chunk, L - a)], [min(a + chunk, L)], [table], q[a:a + chunk])
                         for a in range(0, L, chunk)])
        assert torch.equal(got, whole), chunk
    # the last row alone (a decode) and beside other decodes and a chunk
    alone = _rows(case, [1], [L], [table], q[-1:])
    assert torch.equal(alone, whole[-1:])
    for threads in (1, 2):
        mixed = _rows(case, [1, 1, 5], [L, 1200, 33], [table, *others], torch.cat([q[-1:], case.q[L:L + 1],
                                                                                    q[:5]]), threads)
        assert torch.equal(mixed[:1], whole[-1:])


@needs_kernel
def test_window_rows_are_chunk_invariant():
    L = 520
    case = make_case([L], [L], q_heads=6, kv_heads=2, head_dim=64, block_size=16, dtype=BF16)
    table = case.tables[0]
    from chatserve_kernels import AttentionMetadata

    def attend(ql, sl, rows):
        meta = AttentionMetadata.build([ql], [sl], [table], 16, "cpu")
        out = torch.empty(rows.shape, dtype=rows.dtype)
        assert cpu_attention.paged_attention_cpu(rows.contiguous(), case.k_cache, case.v_cache, meta,
                                                 case.scale, out, sliding_window=300)
        return out
    whole = attend(L, L, case.q)
    tail = attend(20, L, case.q[-20:])
    assert torch.equal(tail, whole[-20:])


def test_unsupported_tensors_fall_back_to_the_twin():
    # an int8 cache, fp16, or a q dtype other than the cache's: the kernel declines, nothing is written
    for dt, kvd in ((F32, "int8"), (torch.float16, "auto")):
        case = make_case([1, 1], [30, 12], q_heads=6, kv_heads=2, head_dim=64, block_size=16, dtype=dt,
                         kv_cache_dtype=kvd)
        out = torch.zeros_like(case.q)
        assert not cpu_attention.paged_attention_cpu(case.q, case.k_cache, case.v_cache, case.meta,
                                                     case.scale, out)
        assert bool((out == 0).all())
        got = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, **case.kwargs())
        assert_close(got, dense_reference(case), dt, TOL_DENSE)
    case = make_case([1], [30], q_heads=6, kv_heads=2, head_dim=64, block_size=16, dtype=BF16)
    assert not cpu_attention.supports(case.q.float(), case.k_cache, case.v_cache)


def test_env_switch_turns_the_kernel_off(tmp_path):
    code = "from chatserve_kernels import cpu_attention; print(cpu_attention.available())"
    env = {**os.environ, "CHATSERVE_CPU_KERNELS": "0", "CHATSERVE_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "False", res.stderr
    assert not any(tmp_path.rglob("*.so"))


def test_missing_compiler_is_a_warning_not_an_error(tmp_path):
    code = ("import logging; logging.basicConfig(); from chatserve_kernels import cpu_attention; "
            "print(cpu_attention.available())")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "CHATSERVE_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "False"
    assert "CPU kernel cpu_attention.c unavailable" in res.stderr


@needs_kernel
def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", str(tmp_path))
    first = cpu_build.build(cpu_attention.SOURCE)
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build(cpu_attention.SOURCE) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]      # no temp files left behind


AVX2_GRID = [c for c in GRID if c[4] in (32, 64, 128) and c[5] % 8 == 0 and c[7] is None][::3]


@needs_kernel
@pytest.mark.parametrize("dt", [F32, BF16])
def test_avx2_body_matches_the_twin_and_is_batch_invariant(dt):
    """Every CPU with AVX2 + FMA also builds the kernel's AVX2 body (the native one here when the CPU has no
    AVX-512): rows against the twin over part of the grid, and one sequence's 300 prompt rows with the same
    bits attended whole (rows grouped 16 to a pass over the keys), in 16-row chunks (groups of 8 at 2
    threads), one by one and at 1 or 2 threads."""
    fn = cpu_attention.avx2_paged_attention()
    if not {"avx2", "fma"} <= cpu_build.cpu_flags():
        assert fn is None
        return
    assert fn is not None and fn.level() == 2 and AVX2_GRID
    for qls, sls, hq, hkv, d, bs, _, _ in AVX2_GRID:
        case = make_case(qls, sls, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt)
        out = torch.empty_like(case.q)
        assert cpu_attention.run(fn, case.q, case.k_cache, case.v_cache, case.meta, case.scale, out, None, None)
        twin = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        assert_close(out, twin, dt, {F32: (2e-5, 2e-5), BF16: (3e-2, 3e-2)})
    L = 300
    case = make_case([L, 1], [L, 500], q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dt)
    table, q = case.tables[0], case.q[:L]
    whole = _rows(case, [L], [L], [table], q, 1, fn)
    assert torch.equal(_rows(case, [L], [L], [table], q, 2, fn), whole)
    for chunk in (16, 1):
        got = torch.cat([_rows(case, [min(chunk, L - a)], [min(a + chunk, L)], [table], q[a:a + chunk], 2, fn)
                         for a in range(0, L, chunk)])
        assert torch.equal(got, whole), chunk
    mixed = _rows(case, [1, 20], [500, L], [case.tables[1], table], torch.cat([case.q[L:], q[-20:]]), 2, fn)
    assert torch.equal(mixed[1:], whole[-20:])
    assert_close(whole, paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)[:L],
                 dt, {F32: (2e-5, 2e-5), BF16: (3e-2, 3e-2)})


# (q_heads, kv_heads, head_dim, block_size, window, softcap): the AVX-512 body's 16-key tiles (block 16/32/64)
# and its key-by-key scores (block 8), GQA 3 and 2 with head_dim 64 and 128, a window rows share the first key
# of (and one they do not: those rows are not grouped), a soft cap
AVX512_GROUP_CASES = [
    (9, 3, 64, 16, None, None),
    (9, 3, 64, 8, None, None),
    (8, 4, 128, 32, None, None),
    (6, 2, 64, 64, None, 5.0),
    (6, 2, 64, 16, 2000, None),
    (6, 2, 64, 16, 300, None),
]


@needs_kernel
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("c", AVX512_GROUP_CASES, ids=[f"h{c[0]}/{c[1]}-d{c[2]}-bs{c[3]}-w{c[4]}-cap{c[5]}"
                                                       for c in AVX512_GROUP_CASES])
def test_avx512_row_group_equals_each_row_alone(dt, c):
    """On an AVX-512 CPU the native build runs the AVX-512 body, which passes up to 16 prompt rows of one
    sequence over each K/V block together (a row group, the block's K/V made fp32 once): every row of a
    40-row chunk over a 530-token cached prefix (1 thread: groups of 16, 16, 8; 2 threads: 16, 4, 16, 4)
    has the bits of that row attended alone (a 1-row call: the ungrouped body, in 256-key segments)."""
    hq, hkv, d, bs, window, cap = c
    fn = cpu_attention.c_paged_attention()
    if "avx512f" not in cpu_build.cpu_flags():
        assert fn.level() != 3
        return
    assert fn.level() == 3
    P, n = 530, 40
    case = make_case([n], [P + n], q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt)
    table = case.tables[0]
    from chatserve_kernels import AttentionMetadata

    def attend(ql, sl, rows, threads):
        meta = AttentionMetadata.build([ql], [sl], [table], bs, "cpu")
        out = torch.empty(rows.shape, dtype=rows.dtype)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert cpu_attention.run(fn, rows.contiguous(), case.k_cache, case.v_cache, meta, case.scale, out,
                                     window, cap)
        finally:
            torch.set_num_threads(before)
        return out
    alone = torch.cat([attend(1, P + r + 1, case.q[r:r + 1], 1) for r in range(n)])
    for threads in (1, 2):
        assert torch.equal(attend(n, P + n, case.q, threads), alone), threads
    twin = paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale, sliding_window=window,
                                 logit_softcap=cap)
    assert_close(alone, twin, dt, {F32: (2e-5, 2e-5), BF16: (3e-2, 3e-2)})
