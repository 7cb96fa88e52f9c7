"""`chatserve bench turn`: the turn's rows run as prompt rows (the dense weights) and the decode step as a
generated row; every op class is counted on the turn, and the counters come off afterwards."""
from __future__ import annotations

from chatserve.bench import turn
from chatserve.runtime.models import layers
from chatserve.runtime.tiny import make_tiny_model


def test_turn_steps_are_prompt_rows_split_by_op_class(tmp_path, linear_rows):
    path = make_tiny_model(tmp_path / "m", seed=4)
    dense = layers.Linear._dense
    args = turn.build_parser().parse_args(
        ["--model", path, "--dtype", "bfloat16", "--weight-quant", "int4", "--context", "40", "--new", "3,8",
         "--rounds", "2"])
    r = turn.measure(args)
    assert set(r["steps"]) == {"decode", "new3", "new8"}
    for kind in ("new3", "new8"):
        m = r["steps"][kind]
        assert m["wall"] > 0 and m["linears_wall"] > 0 and m["attention_wall"] > 0
        assert m["lm_head_wall"] > 0 and m["per_decode_wall"] > 0
    assert r["steps"]["decode"]["per_decode_cpu"] == 1.0
    assert any(s is layers.ALL_PROMPT for s in linear_rows)            # the turns: prompt rows
    # the decode step is a generated row: the decode chain (or the quantized copies), never the dense weights
    assert r["steps"]["decode"]["linears_wall"] == 0
    assert layers.Linear._dense is dense                                 # the counters came off
