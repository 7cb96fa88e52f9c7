"""CpuAttention's flash route (servers without batch invariance): prompt chunks of at least `flash_rows` rows
through torch's flash kernel, every other row through the C kernel on the step's metadata cut to them. Checked
against the dense float64 reference on a step that mixes decode rows, a long chunk over a cached prefix, a
long chunk from position 0 and a short chunk, in fp32 and bf16; and that the default (0) never takes it."""
from __future__ import annotations

import pytest
import torch

from chatserve_kernels import cpu_attention, cpu_extend
from chatserve_kernels.attention_backend import CpuAttention
from kernel_cases import TOL_DENSE, assert_close, dense_reference, make_case

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="cpu_attention did not build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_take_flash_and_the_rest_the_c_kernel(dtype, monkeypatch):
    # decode, long chunk over 40 cached tokens, decode, long chunk from 0, short chunk over 9 cached
    qls, sls = [1, 37, 1, 33, 5], [50, 77, 20, 33, 14]
    case = make_case(qls, sls, q_heads=6, kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=3)
    flashed = []
    real = cpu_extend.extend_attention_flash

    def spy(q, *a, **k):
        flashed.append(q.shape[0])
        return real(q, *a, **k)

    monkeypatch.setattr("chatserve_kernels.attention_backend.extend_attention_flash", spy)
    backend = CpuAttention(flash_rows=32)
    cache = (case.k_cache, case.v_cache)
    got = backend.attend(case.q, cache, case.meta, case.scale, None, None)
    assert flashed == [37, 33]                        # the two long chunks, and only they
    assert_close(got, dense_reference(case), dtype, TOL_DENSE)
    again = backend.attend(case.q, cache, case.meta, case.scale, None, None)   # the next layer: the cut is reused
    assert torch.equal(got, again) and flashed == [37, 33, 37, 33]
    plain = CpuAttention().attend(case.q, cache, case.meta, case.scale, None, None)
    assert flashed == [37, 33, 37, 33]                # flash_rows 0: the C kernel for every row
    short = [0, 38, 72, 73, 74, 75, 76]               # rows of the decode and short-chunk sequences
    assert torch.equal(got[short], plain[short])      # the rows left on the C kernel keep its bits


def test_the_route_is_taken_on_amx_cpus_only():
    """torch's flash kernel is 5x faster than the C kernel on a long bf16 prompt with AMX, and slower without it
    (AVX-512 BF16 on Zen 5, and in float32): a server without batch invariance routes long chunks to it on AMX
    CPUs only."""
    from chatserve.runtime.model_runner import FLASH_PROMPT_ROWS, flash_prompt_rows

    assert flash_prompt_rows({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}) == FLASH_PROMPT_ROWS > 0
    assert flash_prompt_rows({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}) == 0
    assert flash_prompt_rows(set()) == 0
