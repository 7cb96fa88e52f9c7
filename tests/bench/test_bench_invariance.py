"""`chatserve bench invariance`: both modes' steps are timed on one runner, and the mode is really switched
(the Linears see a RowSplit in the invariant mixed steps and none in the others)."""
from __future__ import annotations

from chatserve.bench import invariance
from chatserve.runtime.models import layers
from chatserve.runtime.tiny import make_tiny_model


def test_measures_both_modes_on_both_kinds_of_step(tmp_path, linear_rows):
    path = make_tiny_model(tmp_path / "m", seed=2)
    args = invariance.build_parser().parse_args(
        ["--model", path, "--dtype", "bfloat16", "--weight-quant", "int4", "--streams", "2", "--context", "16",
         "--prompt", "32", "--rounds", "2"])
    r = invariance.measure(args)
    for kind in ("decode", "mixed"):
        for mode in ("on", "off"):
            assert r[f"{kind}_{mode}_ms"] > 0 and r[f"{kind}_{mode}_cpu_ms"] >= 0
    assert r["weight_quant"] == "int4" and r["streams"] == 2
    split = [s for s in linear_rows if s is not None and s.gen is not None]
    assert split and None in linear_rows           # invariant mixed steps split their rows; the other mode does not


def test_bench_model_prefills_run_as_prompt_rows(tmp_path, linear_rows):
    """`bench model`'s prefills are prompt rows (the dense weights), as the server's are: a ScheduledSeq
    without prompt_token_ids would count its rows as generated and time the decode kernels instead."""
    from chatserve.bench.model import _prefill
    from chatserve.config import CacheConfig, ModelConfig
    from chatserve.runtime.model_runner import ModelRunner

    path = make_tiny_model(tmp_path / "m", seed=3)
    runner = ModelRunner(ModelConfig(model=path, dtype="bfloat16", weight_quant="int4"),
                         CacheConfig(num_blocks=16), progress=False)
    linear_rows.clear()                     # only the prefills' calls
    _prefill(runner, 48, repeats=1)
    assert linear_rows and all(r is layers.ALL_PROMPT for r in linear_rows)
