"""A quantized GGUF (Q4_0, as llama.cpp files of Llama 3.2 come) with Llama 3's RoPE scaling stored as
llama.cpp's converter stores it (`rope_freqs`), against transformers float32 on the file's own weights as
transformers' GGUF loader reads them (chatserve.bench.quality.hf_reference): teacher-forced top-1 and
logits over a prompt and 32 decoded tokens, on every path a decode row can take (the C decode chain,
the fused torch path, the plain-torch oracle), float32 and bfloat16, one sequence and four batched.
Before the fix the decode rows ran a second rounding of the Q4_0 weights and drifted (26.6 % top-1 on
the Llama-3.2-1B shape); the prefill rows never did."""
from __future__ import annotations

import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import hf_checkpoints as H  # noqa: E402  (tests/runtime is on sys.path via rootdir conftest)

from chatserve.bench import quality  # noqa: E402

H.SPECS["llama3_q4"] = ("LlamaConfig", dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
    head_dim=64, vocab_size=512, max_position_embeddings=131072, rope_theta=500_000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}))
PROMPT, DECODE, BATCH = 20, 32, 4


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory) -> str:
    return H.save_gguf(H.hf_model("llama3_q4", seed=7), tmp_path_factory.mktemp("q4") / "llama3-q4_0.gguf",
                       qtype="Q4_0")


@functools.lru_cache(maxsize=None)
def _reference(path: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """BATCH sequences (random prompt + transformers' greedy continuation) and transformers' logits."""
    model = quality.hf_reference(path)
    g = torch.Generator().manual_seed(0)
    runs = [quality.reference_run(model, torch.randint(3, 512, (PROMPT,), generator=g).tolist(), DECODE)
            for _ in range(BATCH)]
    return [t for t, _ in runs], [r for _, r in runs]


def _runner(path: str, dtype: str, weight_quant: str | None = "auto"):
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    return ModelRunner.from_config(offline_config(path, dtype=dtype, weight_quant=weight_quant, num_blocks=4 * BATCH,
                                                  block_size=16, num_threads=1, gguf_in_place=False))


def _paths(runner):
    """(name, set-up) of every path a decode row can take on this runner's model."""
    from chatserve.runtime.models import build_model
    from chatserve.runtime.weights import load_weights
    model = runner.model

    def oracle():
        w = load_weights(runner.model_path, runner.model.dtype, progress=False)
        runner.model = build_model(w.config, w.tensors, model.dtype, "cpu", model.max_model_len,
                                   weight_quant=model.weight_quant, fused=False)
    return [("C decode chain", lambda: None), ("fused torch path", lambda: setattr(model, "chain", None)),
            ("plain-torch oracle", oracle)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_0_llama3_file_follows_transformers_on_every_decode_path(q4_file, dtype):
    tokens, refs = _reference(q4_file)
    assert any(len(set(t[PROMPT:])) > 4 for t in tokens)              # not a degenerate repeat
    dense = quality.chatserve_logits(_runner(q4_file, dtype, None), tokens, PROMPT)
    floor = [quality.compare("dense", d, r, PROMPT) for d, r in zip(dense, refs)]
    runner = _runner(q4_file, dtype)
    assert runner.weight_quant == "int4" and runner.model.chain is not None
    for name, set_up in _paths(runner):
        set_up()
        batched = quality.chatserve_logits(runner, tokens, PROMPT)
        for i in range(BATCH):
            alone = quality.chatserve_logits(runner, tokens[i:i + 1], PROMPT)[0]
            assert torch.equal(alone, batched[i]), (name, i)           # batch of 4 = each alone
            a = quality.compare(name, alone, refs[i], PROMPT)
            if dtype == "float32":       # what is left is the 8-bit LM head's x codes: a near-tie may flip
                assert max(a.prefill_max_abs, a.decode_max_abs) < 0.02 * a.logit_scale, a
                assert min(a.prefill_top1, a.decode_top1) >= 0.9, a
            else:                                                      # decode rows: as good as dense bf16
                clear, missed = _confident_misses(alone, refs[i], 0.03 * a.logit_scale)
                assert clear >= DECODE // 3 and missed == [], (name, i, clear, missed, a, floor[i])
                assert a.decode_max_abs < 2 * floor[i].decode_max_abs + 0.05 * a.logit_scale, (a, floor[i])


def _confident_misses(ours: torch.Tensor, ref: torch.Tensor, margin: float) -> tuple[int, list[int]]:
    """Decode positions where transformers' top-1 leads its second by more than `margin`: how many, and those
    where ours picks another token. In bf16 the dense path's logits are off by up to ~8 % of their scale on
    this random model, so top-1 at a near-tie (every miss measured on an EPYC Zen 4: reference margins
    0.01-0.25, against a median of ~0.5) is a coin toss that differs between CPUs, not a quality signal;
    a miss where the reference is clear is one."""
    top2 = ref[PROMPT:].topk(2, -1).values                                   # [decode positions, 2]
    clear = (top2[:, 0] - top2[:, 1]) > margin
    wrong = ours[PROMPT:].argmax(-1) != ref[PROMPT:].argmax(-1)
    return int(clear.sum()), torch.nonzero(clear & wrong).flatten().tolist()


def test_bench_quality_reports_prefill_and_decode_positions(q4_file, capsys):
    assert quality.main(["--model", q4_file, "--prompt", "16", "--decode", "32", "--dtypes", "float32",
                         "--threads", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    (v,) = r["variants"]
    assert (v["prefill_positions"], v["decode_positions"]) == (16, 31)
    assert min(v["prefill_top1"], v["decode_top1"]) >= 0.9 and "decode chain on" in v["variant"]
    assert 0 < v["decode_max_abs"] < 0.02 * v["logit_scale"]
