"""The C decode chain (kernels/cpu_decode.py) against the model's torch path on a tiny int4 checkpoint:
the same logits step after step for 1..4 decoding sequences, and the steps it must leave to the torch
path (prefill chunks, more rows than its limit)."""
from __future__ import annotations

import pytest
import torch

from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
from chatserve.core.request import SamplingParams
from chatserve.config import offline_config
from chatserve.runtime.model_runner import ModelRunner
from chatserve_kernels import cpu_build, cpu_decode

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from chatserve.runtime.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("chain"), "llama", num_hidden_layers=3)


def _runner(path: str, dtype: str) -> ModelRunner:
    r = ModelRunner.from_config(offline_config(path, dtype=dtype, weight_quant="int4", num_blocks=160, block_size=16, num_threads=1))
    if not cpu_decode.usable(r.model.dtype):
        pytest.skip("no C decode chain: " + "; ".join(
            str(cpu_build.status(k)) for k in ("cpu_qmatmul", "cpu_ops", "cpu_attention")))
    assert r.model.chain is not None
    return r


def _steps(runner: ModelRunner, batch: int, use_chain: bool) -> tuple[list[torch.Tensor], int]:
    """Prefill `batch` prompts, then 6 decode steps fed fixed tokens (so that both paths see the same
    inputs); the logits of every step and the number of chain calls."""
    chain = runner.model.chain
    runner.model.chain = chain if use_chain else None
    seen, calls = [], [0]
    logits_fn, run_fn = runner.model.compute_logits, chain.run

    def record(h):
        out = logits_fn(h)
        seen.append(out.clone())
        return out

    def counted(*a):
        calls[0] += 1
        return run_fn(*a)
    runner.model.compute_logits, chain.run = record, counted
    try:
        prompts = [[(7 * i + 3 * b) % 1000 + 1 for i in range(20 + 5 * b)] for b in range(batch)]
        tables = [list(range(8 * b, 8 * b + 8)) for b in range(batch)]
        out = SchedulerOutput(1, [ScheduledSeq(f"s{b}", p, 0, tables[b], True, GREEDY, p) for b, p in enumerate(prompts)])
        runner.execute(out)
        for i in range(6):
            out = SchedulerOutput(2 + i, [ScheduledSeq(f"s{b}", [(31 * i + b) % 1000 + 1], len(prompts[b]) + i,
                                                       tables[b], True, GREEDY, prompts[b]) for b in range(batch)])
            runner.execute(out)
    finally:
        del runner.model.compute_logits
        chain.run = run_fn
        runner.model.chain = chain
    return seen, calls[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chain_matches_the_torch_path(tiny_dir, dtype):
    runner = _runner(tiny_dir, dtype)
    for batch in (1, 3):
        ref, none = _steps(runner, batch, use_chain=False)
        got, calls = _steps(runner, batch, use_chain=True)
        assert none == 0 and calls == 6                     # the prefill stays on the torch path
        assert len(got) == len(ref) == 7
        # not bit for bit: the chain's SiLU uses libm's expf, and a last-bit difference can move an
        # activation across an int8 rounding edge of the next matmul
        tol = 3e-2 if dtype == "float32" else 6e-2
        assert torch.equal(got[0], ref[0])
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, atol=tol, rtol=tol), float((a - b).abs().max())


def test_rows_beyond_the_limit_take_the_torch_path(tiny_dir):
    runner = _runner(tiny_dir, "float32")
    limit = runner.model.chain.max_rows
    _, calls = _steps(runner, limit + 1, use_chain=True)
    assert calls == 0
