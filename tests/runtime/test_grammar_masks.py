"""Compiler and grammar masks on the default model's real tokenizer: errors, cache, masking, replay on resume."""
from __future__ import annotations

import json

import pytest
import torch

from chatserve.core.outputs import ScheduledSeq
from chatserve.core.request import SamplingParams
from chatserve.runtime.sampler import Sampler
from chatserve.structured.compiler import GrammarCompiler, GrammarError, _TokenTable
from chatserve.runtime.grammar_masks import GrammarMasks, add_bitmask, fill_bitmask
from chatserve.structured.response_format import response_format_spec
from chatserve.structured.spec import StructuredSpec

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}}


@pytest.fixture(scope="module")
def tok():
    from chatserve.config import default_model_path
    from chatserve.text import Tokenizer
    path = default_model_path()
    if path is None:
        pytest.skip("default model not installed")
    return Tokenizer.from_model(path)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.vocab_size)


def _spec(compiler, schema=SCHEMA) -> StructuredSpec:
    return compiler.compile(response_format_spec({"type": "json_schema", "json_schema": {"schema": schema}}))


def _seq(rid: str, spec, out: list[int], temperature: float = 0.0) -> ScheduledSeq:
    return ScheduledSeq(request_id=rid, token_ids=[1], start_pos=5, block_table=[0], sample=True,
                        params=SamplingParams(temperature=temperature, structured=spec), prompt_token_ids=[1] * 5,
                        output_token_ids=out)


def test_cache_hits_on_equal_schemas(compiler):
    before = compiler.misses
    a = _spec(compiler)
    b = _spec(compiler, json.loads(json.dumps(SCHEMA)))
    assert a.compiled is b.compiled and compiler.misses <= before + 1 and compiler.hits >= 1


@pytest.mark.parametrize("spec,needle", [
    (StructuredSpec("regex", "a(b"), "regex"),
    (StructuredSpec("grammar", 'root ::= "a" missing'), "missing"),
    (StructuredSpec("json_schema", json.dumps({"type": "string", "format": "no-such-format"})), "format"),
])
def test_compile_errors_name_the_problem(compiler, spec, needle):
    with pytest.raises(GrammarError, match=needle):
        compiler.compile(spec)


def test_greedy_sampler_follows_the_grammar_to_eos(tok, compiler):
    """Random logits, greedy: every token is one the grammar allows, and the text is valid JSON."""
    spec = _spec(compiler)
    sampler = Sampler()
    out: list[int] = []
    g = torch.Generator().manual_seed(0)
    eos = set(tok.eos_token_ids)
    for _ in range(60):
        logits = torch.randn(2, tok.vocab_size, generator=g)      # [B, V]; row 1 is unconstrained
        free = ScheduledSeq(request_id="free", token_ids=[1], start_pos=5, block_table=[0], sample=True,
                            params=SamplingParams(temperature=0.0), prompt_token_ids=[1] * 5)
        ids, _ = sampler(logits.clone(), [_seq("c", spec, out), free])
        assert ids[1] == int(logits[1].argmax())
        if ids[0] in eos:
            break
        out.append(ids[0])
    assert ids[0] in eos
    doc = json.loads(tok.decode(out))
    assert set(doc) == {"a", "b"} and doc["b"] in ("x", "y")


def test_lost_state_is_rebuilt_from_the_output_so_far(tok, compiler):
    """A preempted or re-admitted request: a fresh GrammarMasks replays its output tokens first."""
    spec = _spec(compiler)
    prefix = tok.encode('{"a":12')
    masks = GrammarMasks()
    logits = torch.zeros(1, tok.vocab_size)
    masks.apply(logits, [_seq("r", spec, prefix)], [0])
    allowed = set((logits[0] == 0).nonzero().squeeze(1).tolist())
    texts = {tok.decode([i]) for i in allowed}
    assert "," in texts and "}" not in texts and '"' not in texts      # more digits or the next key
    # and a dropped token (a shorter output than the matcher has seen) is rolled back
    masks.accept([_seq("r", spec, prefix)], [0], [tok.encode(",")[0]], tok.vocab_size)
    logits = torch.zeros(1, tok.vocab_size)
    masks.apply(logits, [_seq("r", spec, prefix)], [0])
    assert set((logits[0] == 0).nonzero().squeeze(1).tolist()) == allowed


@pytest.mark.parametrize("overlap", [True, None])
def test_mask_prefetched_during_the_forward_samples_the_same_tokens(tok, compiler, overlap):
    """Seeded sampling at temperature 1 over random logits: masks computed on the helper thread ahead
    (after the last step's tokens, and before the step as the runner does during the forward; None:
    the server's rule) give the tokens the inline fill gives, also when a prefetched row drops out of
    the step (its forward failed), comes back, or was not prefetched."""
    spec = _spec(compiler)

    def run(prefetch: bool) -> list[list[int]]:
        sampler = Sampler()
        sampler._grammar_masks().overlap = overlap if prefetch else False
        outs: list[list[int]] = [[], [], []]
        g = torch.Generator().manual_seed(1)
        for step in range(40):
            seqs = [_seq(f"r{i}", spec, outs[i], temperature=1.0) for i in range(3)]
            for i, s in enumerate(seqs):
                s.seed = 7 + i
            sampler.prefetch_masks(seqs[:2] if step % 3 == 0 else seqs, tok.vocab_size)
            step_seqs = seqs[1:] if step % 5 == 0 else seqs        # r0's forward "failed" this step
            logits = torch.randn(len(step_seqs), tok.vocab_size, generator=g)
            ids, _ = sampler(logits, step_seqs)
            for s, t in zip(step_seqs, ids):
                outs[int(s.request_id[1:])].append(t)
        sampler.drop(["r0", "r1", "r2"])
        return outs

    inline, fetched = run(False), run(True)
    assert inline[0] and inline == fetched


@pytest.mark.parametrize("vocab", [96, 100])
def test_both_bitmask_applications_equal_masked_fill(vocab):
    """The CPU path (a float mask added) and the device path (unpacked there, masked_fill_) give exactly
    the logits masked_fill_ with the unpacked bits gives: all rows, some rows, a reused buffer."""
    g = torch.Generator().manual_seed(3)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1                     # everything allowed
    bitmask[2, :-1] = 0                 # only the last word's tokens may be allowed
    forbid = torch.tensor([[not (int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)])
    for batch, rows in ((3, [0, 1, 2]), (5, [0, 2, 3])):
        logits = torch.randn(batch, vocab, generator=g)
        want = logits.clone()
        for r, i in enumerate(rows):
            want[i].masked_fill_(forbid[r], float("-inf"))
        added, filled = logits.clone(), logits.clone()
        buffer = add_bitmask(added, rows, bitmask)
        fill_bitmask(filled, rows, bitmask)
        assert torch.equal(added, want) and torch.equal(filled, want)
        again = logits[:1].clone()
        assert add_bitmask(again, [0], bitmask[2:], buffer) is buffer        # fewer rows: the same buffer
        assert torch.equal(again, logits[:1].masked_fill(forbid[2:], float("-inf")))


def test_token_table_remembers_encodings(tok):
    table = _TokenTable(tok, tok.vocab_size)
    first = table(b',"genre"')
    first.append(-1)                                    # a caller's list is its own
    assert table(b',"genre"') == table(',"genre"') == tok.encode(',"genre"')
