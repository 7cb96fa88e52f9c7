"""`chatserve bench kernels`: says "needs CUDA" and exits 0 on CPU; the quality harness runs on CPU."""
from __future__ import annotations

import json
import os

import pytest
import torch

from chatserve.bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: this checks the CPU-only behaviour")
def test_decode_bench_needs_cuda_and_exits_zero(capsys):
    assert bench.main([]) == 0
    assert "needs CUDA" in capsys.readouterr().out
    assert bench.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == "needs CUDA"


def test_cli_dispatches_to_the_kernel_bench(capsys):
    from chatserve.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--help"])
    assert e.value.code == 0
    assert "--quality" in capsys.readouterr().out


@pytest.mark.slow
def test_quality_harness_on_the_default_model(capsys):
    from chatserve.config import default_model_path
    if default_model_path() is None:
        pytest.skip("default model not installed")
    assert bench.main(["--quality", "--json", "--cpu", "--prompts", "2", "--max-tokens", "3",
                       "--kv-cache-dtypes", "int8"]) == 0
    res = json.loads(capsys.readouterr().out)
    (row,) = res["results"]
    assert row["kv_cache_dtype"] == "int8" and 0 < row["max_abs_logit_err"] < 5
    assert row["greedy_identical"].endswith("/2")


def test_decode_bench_dry_run_exercises_the_gpu_code_path(capsys):
    # the decode benchmark's code, on CPU through the Triton interpreter: catches errors before a GPU run
    from chatserve_kernels.dispatch import interpreting
    if not interpreting():
        pytest.skip("needs triton's CPU interpreter")
    before = os.environ.get("CHATSERVE_FORCE_TRITON")
    assert bench.main(["--dry-run", "--json", "--batches", "1,2", "--contexts", "40", "--q-heads", "4",
                       "--kv-heads", "2", "--head-dim", "64", "--no-baselines", "--dtype", "fp32"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["batch"], r["context"]) for r in res["rows"]] == [(1, 40), (2, 40)]
    row = res["rows"][1]
    # K/V of 2 seqs × 40 tokens × 2 kv heads × 64 dims × fp32 × (K and V), plus q and out
    assert row["kv_bytes"] == 2 * 40 * 2 * 64 * 4 * 2 + 2 * (2 * 4 * 64 * 4)
    assert row["triton_us"] > 0 and row["sdpa_us"] > 0
    assert os.environ.get("CHATSERVE_FORCE_TRITON") == before   # nothing leaks into later tests
