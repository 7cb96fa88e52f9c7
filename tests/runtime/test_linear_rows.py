"""A prompt row's bits through a Linear's dense weight do not depend on how many rows share the call
(batch invariance, issue 28): oneDNN's bf16 GEMM picks its kernel by M (on AMX, and on AVX-512 BF16 without
it: Zen 4, K = 1,536, M <= 10 vs M >= 11), so the Linear runs batch-invariant bf16 rows in calls of exactly
AMX_ROWS rows on AMX (layers.Linear._fixed_rows) and of at least BF16_MIN_M rows elsewhere; MKL's fp32 GEMM picks
its kernel by M and shape on some CPUs (Sapphire Rapids), so fp32 weights go through oneDNN's packed fp32
GEMM, padded to 4 rows."""
from __future__ import annotations

import pytest
import torch

from chatserve.runtime.models.layers import ALL_PROMPT, AMX_ROWS, BF16_MIN_M, Linear, _onednn_amx


@pytest.mark.parametrize("n,k", [(576, 576), (3072, 576), (576, 1536), (960, 576), (1536, 2048)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,quant", [(torch.bfloat16, "int4"), (torch.float32, None), (torch.float32, "int8")])
def test_prompt_rows_keep_their_bits_at_any_row_count(n, k, threads, dtype, quant):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n + k)
        lin = Linear(torch.randn(n, k, generator=g).to(dtype), None, quant)
        x = torch.randn(600, k, generator=g).to(dtype)                           # [600, K]
        alone = torch.cat([lin(x[i:i + 1], ALL_PROMPT) for i in range(70)])      # [70, N]
        assert alone.abs().sum() > 0
        for m in (2, 4, 5, 10, 11, 15, 16, 31, 33, 57, 64, 65, 70, 300, 600):      # 300, 600: long chunks
            assert torch.equal(lin(x[:m], ALL_PROMPT)[:70], alone[:m]), f"{m} rows"
        assert torch.equal(lin(x[3:140], ALL_PROMPT)[:67], alone[3:70]), "rows shifted within the call"
    finally:
        torch.set_num_threads(old)


def test_fixed_rows_wherever_onednn_runs_bf16():
    lin = Linear(torch.randn(64, 64).bfloat16())
    assert lin.fixed_m == (AMX_ROWS if lin.packed is not None and _onednn_amx() else 0)
    assert lin.min_m == (BF16_MIN_M if lin.packed is not None and not _onednn_amx() else 0)
    assert Linear(torch.randn(64, 64)).fixed_m == 0                  # fp32 never takes AMX tiles
    x = torch.randn(5, 64).bfloat16()
    assert lin(x, ALL_PROMPT).shape == (5, 64)
