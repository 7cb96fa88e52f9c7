"""`chatserve bench model --agreement`: greedy outputs of variants against fp32 dense weights."""
from __future__ import annotations

from chatserve.bench.model import agreement
from chatserve.runtime.tiny import make_tiny_model


def test_agreement_reports_each_variant(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=1)
    rep = agreement(path, ["float32", "bfloat16"], max_tokens=4)
    assert rep["prompts"] == 20 and rep["max_tokens"] == 4
    same, bf16 = rep["results"]
    assert same == {"variant": "float32", "dtype": "float32", "weight_quant": None, "identical": 20,
                    "mean_matching_prefix": 4.0}                      # fp32 against itself
    assert bf16["dtype"] == "bfloat16" and 0 <= bf16["identical"] <= 20
    assert 0 <= bf16["mean_matching_prefix"] <= 4
