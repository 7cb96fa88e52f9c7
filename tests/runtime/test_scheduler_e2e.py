"""The scheduler end to end on a real (tiny, random-weight) model: greedy outputs do not depend on
prefix caching, on preemption under a tiny KV cache, or on running alone versus in a batch of 8."""
from __future__ import annotations

import random

import pytest

from chatserve.core.request import SamplingParams
from chatserve.engine.llm import LLM
from chatserve.config import offline_config
from chatserve.runtime.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(49152) for _ in range(32)]               # two full blocks shared by half of them
    out = []
    for i in range(8):
        tail = [rng.randrange(49152) for _ in range(rng.randint(5, 38))]
        out.append(shared + tail if i % 2 else tail)
    return out


@pytest.fixture(scope="module")
def runners(tiny_dirs) -> dict[str, ModelRunner]:
    path = tiny_dirs["llama"]
    return {"roomy": ModelRunner.from_config(offline_config(path, num_blocks=256)),
            "tiny": ModelRunner.from_config(offline_config(path, num_blocks=12))}     # 8 × up to 6 blocks → preemption


@pytest.fixture(scope="module")
def alone(runners, prompts) -> list[list[int]]:
    return [LLM(runner=runners["roomy"], enable_prefix_caching=False, eos_token_ids=[]).generate([p], GREEDY)[0]
            for p in prompts]


def test_batch_of_8_equals_alone(runners, prompts, alone):
    llm = LLM(runner=runners["roomy"], enable_prefix_caching=False, eos_token_ids=[])
    assert llm.generate(prompts, GREEDY) == alone


def test_prefix_caching_changes_nothing(runners, prompts, alone):
    llm = LLM(runner=runners["roomy"], enable_prefix_caching=True, eos_token_ids=[],
              max_num_batched_tokens=64)                                 # chunked prefill as well
    assert llm.generate(prompts, GREEDY) == alone
    assert llm.generate(prompts, GREEDY) == alone                       # second round: prompts hit the cache
    stats = llm.kv.stats()
    assert stats.prefix_hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)   # round 2: every full block


def test_preemption_under_a_tiny_cache_changes_nothing(runners, prompts, alone):
    llm = LLM(runner=runners["tiny"], enable_prefix_caching=True, eos_token_ids=[])
    assert llm.generate(prompts, GREEDY) == alone
    assert llm.scheduler.num_preemptions > 0
    assert llm.kv.stats().used_blocks == 0
    llm.kv.check_integrity()
