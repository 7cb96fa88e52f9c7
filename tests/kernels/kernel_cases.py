"""Builders for kernel tests: a filled paged KV cache with shuffled blocks, its metadata, a dense oracle.

Shared by the interpreter grid (CPU) and the CUDA grid; holds no test itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from chatserve_kernels import AttentionMetadata, allocate_kv_cache
from chatserve_kernels.dispatch import HAS_TRITON, interpreting
from chatserve_kernels.kv_store import store_kv_torch
from chatserve_kernels.quant import dequantize_torch

needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()),
    reason="needs triton's CPU interpreter (TRITON_INTERPRET=1 before triton is imported; no CUDA)")
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA + triton")

# max |triton - twin| allowed, as (atol, rtol), by query/output dtype. fp32 differs only by summation
# order; fp16/bf16 by one or two output roundings (the interpreter rounds bf16 by truncation).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}
# max |twin - dense float64 oracle| on the same (dequantized) K/V
TOL_DENSE = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


# one byte of a code that decodes to a large value, per cache dtype (written into every unused slot)
_LOUD = {torch.float32: 0x46, torch.float16: 0x70, torch.bfloat16: 0x46, torch.int8: 0x7F,
         torch.float8_e4m3fn: 0x7E}


@dataclass
class PagedCase:
    q: torch.Tensor              # [T, hq, D]
    k_cache: torch.Tensor        # [NB, BS, hkv, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    meta: AttentionMetadata
    tables: list[list[int]]
    scale: float

    def kwargs(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def make_case(query_lens: list[int], seq_lens: list[int], *, q_heads: int, kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto", seed: int = 0,
              device: str = "cpu", spare_blocks: int = 3) -> PagedCase:
    """Sequences of seq_lens tokens (the last query_lens of them new) in randomly placed blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [(sl + block_size - 1) // block_size for sl in seq_lens]
    nb = sum(need) + spare_blocks
    k, v, ks, vs = allocate_kv_cache(nb, block_size, kv_heads, head_dim, dtype, kv_cache_dtype, device)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    slots = [t[p // block_size] * block_size + p % block_size for t, sl in zip(tables, seq_lens)
             for p in range(sl)]
    keys = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype)
    vals = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype)
    if kv_cache_dtype == "fp8_per_tensor":
        ks.fill_(0.05)
        vs.fill_(0.02)
    store_kv_torch(keys.to(device), vals.to(device), k, v, torch.tensor(slots, device=device), ks, vs)
    # garbage in the unused spare blocks and the tail of partly filled blocks must never leak in
    used = torch.zeros(nb * block_size, dtype=torch.bool)
    used[torch.tensor(slots, dtype=torch.long)] = True
    free = (~used).nonzero()[:, 0].to(device)
    for cache in (k, v):  # large finite values: a leak shows in the output, the twin's 0-weights stay 0
        cache.view(torch.uint8).view(nb * block_size, kv_heads, -1)[free] = _LOUD[cache.dtype]
    for scale in (ks, vs):
        if scale is not None and scale.dim() == 3:
            scale.view(-1, kv_heads)[free] = 100.0
    q = torch.randn(sum(query_lens), q_heads, head_dim, generator=g).to(dtype).to(device)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    return PagedCase(q, k, v, ks, vs, meta, tables, head_dim ** -0.5)


def dense_reference(case: PagedCase, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in float64 on each sequence's gathered, contiguous (dequantized) K/V
    (scores soft-capped to c·tanh(s / c) with logit_softcap c; with sinks [hq], each head's sink logit
    joins the softmax as one more column that is then dropped, as transformers' gpt-oss does)."""
    q, meta = case.q, case.meta
    bs = case.k_cache.shape[1]
    hq, hkv = q.shape[1], case.k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (ql, sl) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
        pos = torch.arange(sl)
        slots = torch.tensor(case.tables[b], dtype=torch.long)[pos // bs] * bs + pos % bs
        k = _dense(case.k_cache, case.k_scale, slots)                        # [sl, hkv, D]
        v = _dense(case.v_cache, case.v_scale, slots)
        k = k.repeat_interleave(hq // hkv, dim=1)                             # [sl, hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        qb = q[start:start + ql].cpu().double()                               # [ql, hq, D]
        s = torch.einsum("qhd,khd->hqk", qb, k) * case.scale                  # [hq, ql, sl]
        if logit_softcap:
            s = torch.tanh(s / logit_softcap) * logit_softcap
        qpos = torch.arange(sl - ql, sl)[:, None]
        mask = pos[None, :] <= qpos
        if sliding_window:
            mask &= (qpos - pos[None, :]) < sliding_window
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(hq, ql, 1)
            p = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", p, v)
        start += ql
    return out


def _dense(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    nb, bs, h, d = cache.shape
    codes = cache.cpu().view(nb * bs, h, d)[slots]
    if scale is not None and scale.dim() == 3:
        return dequantize_torch(codes, scale.cpu().view(nb * bs, h)[slots], torch.float64)
    return dequantize_torch(codes, None if scale is None else scale.cpu(), torch.float64)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol: dict = TOL) -> None:
    atol, rtol = tol[dtype]
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert torch.isfinite(a).all(), "non-finite output"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3e} (atol {atol}, rtol {rtol})"


# ============================================================================ the attention grid
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


def case_id(c) -> str:
    return "-".join(str(getattr(x, "__name__", x)).replace("torch.", "") for x in c if x is not None)


def decode_case(c, seed: int = 0, device: str = "cpu"):
    seq_lens, hq, hkv, d, bs, dt, kvd, splits, window = c
    case = make_case([1] * len(seq_lens), seq_lens, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs,
                     dtype=dt, kv_cache_dtype=kvd, seed=seed, device=device)
    return case, dt, splits, window


def extend_case(c, seed: int = 0, device: str = "cpu"):
    qls, sls, hq, hkv, d, bs, dt, kvd, window = c
    case = make_case(qls, sls, q_heads=hq, kv_heads=hkv, head_dim=d, block_size=bs, dtype=dt,
                     kv_cache_dtype=kvd, seed=seed, device=device)
    return case, dt, window


# (tokens, kv_heads, head_dim, num_blocks, block_size, key dtype, kv_cache_dtype)
STORE = [
    (7, 3, 64, 4, 16, F32, "auto"), (9, 2, 128, 3, 8, F16, "auto"), (5, 4, 64, 2, 32, BF16, "auto"),
    (7, 3, 64, 4, 16, F32, "int8"), (9, 2, 128, 3, 8, F16, "int8"), (5, 4, 64, 2, 32, BF16, "int8"),
    (7, 3, 64, 4, 16, F32, "fp8"), (9, 2, 128, 3, 8, BF16, "fp8"), (6, 1, 64, 2, 16, F16, "fp8_per_tensor"),
    (7, 3, 64, 4, 16, F32, "float16"),
]


def store_inputs(T: int, H: int, D: int, nb: int, bs: int, dt: torch.dtype, seed: int):
    """New keys/values [T, H, D] (one all-zero head) and distinct slots of nb×bs, one of them -1."""
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(T, H, D, generator=g) * 3).to(dt)
    val = torch.randn(T, H, D, generator=g).to(dt)
    key[0, 0] = 0.0                                             # an all-zero head: scale 0, codes 0
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[T // 2] = -1                                          # skipped token
    return key, val, slots
