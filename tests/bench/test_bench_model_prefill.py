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
