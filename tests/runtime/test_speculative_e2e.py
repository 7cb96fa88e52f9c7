"""Speculative decoding (--speculative-ngram) end to end on real models: greedy outputs are token-identical
with and without it — on tiny random-weight models (the tied-embedding one repeats itself, so drafts are
accepted) and on the default model asked to fix the typos in a text (drafts accepted and rejected).
"""
from __future__ import annotations

import random

import pytest

from chatserve.core.request import SamplingParams
from chatserve.engine.llm import LLM
from chatserve.config import offline_config
from chatserve.runtime.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    out = []
    for i in range(6):
        chunk = [rng.randrange(49152) for _ in range(rng.randint(4, 12))]
        out.append(chunk * 3 + chunk[:i])             # prompts that repeat themselves
    return out


def _generate(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams, **settings) -> tuple:
    llm = LLM(runner=runner, eos_token_ids=[], **settings)
    outs = llm.generate(prompts, params)
    llm.kv.check_integrity()
    assert llm.kv.stats().used_blocks == 0
    return outs, llm.scheduler


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_greedy_outputs_identical_with_drafts(tiny_dirs, prompts, arch):
    runner = ModelRunner.from_config(offline_config(tiny_dirs[arch], num_blocks=256))
    plain, _ = _generate(runner, prompts, GREEDY)
    # one at a time (the default: drafting only while one sequence runs), then all at once with
    # drafting kept on for a batch of 8 (decodes with drafts beside prefill chunks)
    alone, drafted_alone = [], 0
    for p in prompts:
        out, one = _generate(runner, [p], GREEDY, speculative_ngram=True)
        alone += out
        drafted_alone += one.spec_num_draft_tokens
    batch, sched = _generate(runner, prompts, GREEDY, speculative_ngram=True, speculative_disable_by_batch_size=8,
                             max_num_batched_tokens=32)
    assert alone == plain and batch == plain
    if arch == "qwen2":   # tied embeddings: the model repeats its last token, so drafts are right
        assert drafted_alone > 0 and sched.spec_num_accepted_tokens > 0


def test_tiny_sampled_rows_are_unaffected_by_the_option(tiny_dirs, prompts):
    runner = ModelRunner.from_config(offline_config(tiny_dirs["qwen2"], num_blocks=256))
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)
    plain, _ = _generate(runner, prompts[:2], seeded)
    spec, sched = _generate(runner, prompts[:2], seeded, speculative_ngram=True, speculative_disable_by_batch_size=8)
    assert spec == plain and sched.spec_num_draft_tokens == 0


EDIT_TEXT = ("Teh quick brown fox jumsp over the lazy dog. It was a brigth cold day in April, and the "
             "clocks were striking thirteen. Alice was begining to get very tired of siting by her sister "
             "on the bank, and of having nothing to do.")


def test_default_model_editing_prompt_identical_and_accepted(default_path, default_weights):
    runner = ModelRunner.from_config(offline_config(default_path, num_blocks=64), weights=default_weights)
    tok = LLM(runner=runner).tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Fix the typos in this text and reply with "
                                    "the corrected text only.\n\n" + EDIT_TEXT}])
    params = SamplingParams(temperature=0.0, max_tokens=64)
    llm = LLM(runner=runner)
    plain = llm.generate([ids], params)[0]
    spec_llm = LLM(runner=runner, speculative_ngram=True)
    spec = spec_llm.generate([ids], params)[0]
    assert plain and spec == plain
    s = spec_llm.scheduler
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens      # some drafts right, some wrong
    assert spec_llm.num_steps < llm.num_steps
    assert "quick brown fox" in tok.decode(spec)
