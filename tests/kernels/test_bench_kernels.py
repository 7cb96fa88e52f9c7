"""`chatserve bench kernels`: says "needs CUDA" and exits 0 on CPU; the quality harness runs on CPU."""
from __future__ import annotations

import json

import pytest
import torch

from chatserve.bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
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
