"""`chatserve bench model --agreement`: greedy outputs of variants against fp32 dense weights."""
from __future__ import annotations

from chatserve.bench.model import agreement
from chatserve.engine.llm import LLM
from chatserve.runtime.tiny import make_tiny_model


def test_agreement_reports_each_variant(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "m", seed=1)
    outputs: dict[str, list[list[int]]] = {}           # dtype → the continuations the bench got
    generate = LLM.generate

    def recording(self, prompts, params):
        out = generate(self, prompts, params)
        outputs.setdefault(str(self.runner.dtype).removeprefix("torch."), out)
        return out

    monkeypatch.setattr(LLM, "generate", recording)
    rep = agreement(path, ["float32", "bfloat16"], max_tokens=4)
    assert rep["prompts"] == 20 and rep["max_tokens"] == 4
    same, bf16 = rep["results"]
    assert same == {"variant": "float32", "dtype": "float32", "weight_quant": None, "identical": 20,
                    "mean_matching_prefix": 4.0}                      # fp32 against itself
    # bf16 against fp32, recounted here from the continuations both runs produced
    ref, got = outputs["float32"], outputs["bfloat16"]
    assert len(ref) == len(got) == 20 and all(len(a) == 4 for a in ref)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 4) for a, b in zip(ref, got)]
    assert bf16["dtype"] == "bfloat16" and bf16["weight_quant"] is None
    assert bf16["identical"] == sum(a == b for a, b in zip(ref, got))
    assert bf16["mean_matching_prefix"] == sum(prefix) / 20
