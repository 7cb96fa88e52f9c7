"""Structured output after the reasoning: the grammar starts after the end-of-thinking token, and a
think block may open the output (StructuredSpec.think), on the default model's real tokenizer."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from chatserve.core.outputs import ScheduledSeq
from chatserve.core.request import SamplingParams
from chatserve.runtime.sampler import Sampler
from chatserve.structured.compiler import GrammarCompiler
from chatserve.structured.response_format import response_format_spec

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a"],
          "properties": {"a": {"enum": ["x", "y"]}}}


@pytest.fixture(scope="module")
def tok():
    from chatserve.config import default_model_path
    from chatserve.text import Tokenizer
    return Tokenizer.from_model(default_model_path())


@pytest.fixture(scope="module")
def spec(tok):
    c = GrammarCompiler(tok, tok.vocab_size)
    return c.compile(response_format_spec({"type": "json_schema", "json_schema": {"schema": SCHEMA}}))


def _run(tok, spec, script: dict[int, int], steps: int = 80) -> list[int]:
    """Greedy on random logits; at step k the token script[k] is pushed to the top."""
    sampler = Sampler()
    out: list[int] = []
    g = torch.Generator().manual_seed(1)
    eos = set(tok.eos_token_ids)
    for k in range(steps):
        logits = torch.randn(1, tok.vocab_size, generator=g)        # [1, V]
        if k in script:
            logits[0, script[k]] = 100.0
        seq = ScheduledSeq(request_id="r", token_ids=[1], start_pos=5, block_table=[0], sample=True,
                           params=SamplingParams(temperature=0.0, structured=spec), prompt_token_ids=[1] * 5,
                           output_token_ids=list(out))
        ids, _ = sampler(logits, [seq])
        if k in script:
            assert ids[0] == script[k], k
        out.append(ids[0])
        if ids[0] in eos:
            break
    assert out[-1] in eos, repr(tok.decode(out))
    return out[:-1]


def _tokens(tok, text: str) -> list[int]:
    return list(tok.encode(text))


def test_output_opened_block_then_json(tok, spec):
    start, end = _tokens(tok, " hello")[0], _tokens(tok, " world")[0]
    thought = _tokens(tok, " so I think not json at all")
    gated = dataclasses.replace(spec, think=(start, end))
    script = {0: start, **{1 + i: t for i, t in enumerate(thought)}, 1 + len(thought): end}
    out = _run(tok, gated, script)
    k = out.index(end)
    assert out[0] == start and out[1:k] == thought
    assert json.loads(tok.decode(out[k + 1:]))["a"] in ("x", "y")


def test_no_block_means_grammar_from_the_first_token(tok, spec):
    start, end = _tokens(tok, " hello")[0], _tokens(tok, " world")[0]
    brace = _tokens(tok, "{")[0]
    out = _run(tok, dataclasses.replace(spec, think=(start, end)), {0: brace})
    assert out[0] == brace
    assert json.loads(tok.decode(out))["a"] in ("x", "y")


def test_template_opened_block(tok, spec):
    end = _tokens(tok, " world")[0]
    thought = _tokens(tok, "not json {{{")
    script = {i: t for i, t in enumerate(thought)} | {len(thought): end}
    out = _run(tok, dataclasses.replace(spec, think=(None, end)), script)
    assert out[:len(thought)] == thought and out[len(thought)] == end
    assert json.loads(tok.decode(out[len(thought) + 1:]))["a"] in ("x", "y")
