"""`chatserve bench model`'s prefill and interference measurements on a tiny model: every requested
length measured in one run, the chunked prefill and the decode-beside-prefill steps reported (their
shape, never their speed)."""
from __future__ import annotations

import pytest

from chatserve.bench import model as bench_model
from chatserve.config import offline_config
from chatserve.runtime.model_runner import ModelRunner


def test_prefill_lengths_chunks_and_interference(tiny_model):
    runner = ModelRunner.from_config(offline_config(tiny_model, num_blocks=256, block_size=16, num_threads=1))
    one = bench_model._prefill(runner, 70, repeats=1)
    chunked = bench_model._prefill(runner, 70, repeats=1, chunk=32)
    assert one["chunk"] == 70 and chunked["chunk"] == 32
    assert one["tokens_per_s"] > 0 and chunked["peak_rss_mib"] > 0
    it = bench_model._interference(runner, cap=16, context=10, prompt_len=50, streams=4, alone_steps=4)
    assert it["cap"] == 16 and it["prompt"] == 50 and it["steps"] == 4      # 16 + 16 + 16 + 2
    assert it["itl_mixed_ms_p99"] >= it["itl_mixed_ms_p50"] > 0 and it["itl_alone_ms_p99"] > 0
    assert it["prompt_ttft_s"] > 0 and it["itl_p99_ratio"] > 0
    assert it["itl_mixed_cpu_ms_p99"] > 0 and it["prompt_ttft_cpu_s"] > 0 and it["itl_cpu_p99_ratio"] > 0


def test_percentile_interpolates_between_ranks():
    assert bench_model._percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench_model._percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert bench_model._percentile([5.0], 99) == 5.0


def test_parser_takes_a_list_of_prefill_lengths():
    args = bench_model.build_parser().parse_args(["--prefill-tokens", "512,4000,8000", "--interference", "64,512"])
    assert bench_model._parse_list(args.prefill_tokens, int) == [512, 4000, 8000]
    assert bench_model._parse_list(args.interference, int) == [64, 512]


def test_moe_ab_alternates_the_one_call_and_the_loop_and_restores_it():
    """--moe-ab: per batch, rounds of (one call, loop) in alternating order, the layers switched between
    runs and left as they were; a model without cpu_moe layers is refused."""
    from types import SimpleNamespace as NS

    layers = [NS(mlp=NS(packed="table0")), NS(mlp=NS(packed="table1")), NS(mlp=object())]
    runner = NS(model=NS(layers=layers))
    seen = []
    for b, label in bench_model._decode_plan(runner, [1, 16], 2):
        seen.append((b, label, layers[0].mlp.packed, layers[1].mlp.packed))
    assert seen == [(1, "moe-c", "table0", "table1"), (1, "moe-loop", None, None),
                    (1, "moe-loop", None, None), (1, "moe-c", "table0", "table1"),
                    (16, "moe-c", "table0", "table1"), (16, "moe-loop", None, None),
                    (16, "moe-loop", None, None), (16, "moe-c", "table0", "table1")]
    assert (layers[0].mlp.packed, layers[1].mlp.packed) == ("table0", "table1")
    assert list(bench_model._decode_plan(runner, [4], 0)) == [(4, "")]
    with pytest.raises(SystemExit, match="no MoE layer"):
        list(bench_model._decode_plan(NS(model=NS(layers=[NS(mlp=object())])), [1], 1))
