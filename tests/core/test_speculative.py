"""Speculative decoding bookkeeping (no torch): the prompt-lookup proposer alone, and the scheduler with
scripted runner outputs — drafts scheduled and budgeted, accepted runs cut at stops and limits, rejected
drafts' blocks given back, aborts and preemption with drafts, outputs identical with and without.
"""
from __future__ import annotations

from collections import defaultdict

import pytest

from chatserve.config import SchedulerConfig
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.ngram_proposer import NgramProposer, can_draft
from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import FinishReason, Request, SamplingParams
from chatserve.core.scheduler import Scheduler

import scripted_model

VOCAB = 64
EOS = 0


# ---------------------------------------------------------------------------- the proposer
def test_proposer_follows_the_most_recent_longest_match():
    p = NgramProposer(3, max_n=3, min_n=1)
    # [7 8 9] recurs at 0 and 5; the most recent earlier one (5) is followed by 40 41 42
    tokens = [7, 8, 9, 30, 31, 7, 8, 9, 40, 41, 42, 7, 8, 9]
    assert p.propose(tokens) == [40, 41, 42]
    # n = 3 fails ([5 8 9] never recurs); n = 2 ([8 9]) does, most recently at 12
    assert p.propose(tokens + [5, 8, 9]) == [5, 8, 9]


def test_proposer_prefers_a_longer_match_over_a_more_recent_shorter_one():
    p = NgramProposer(2, max_n=3, min_n=1)
    tokens = [1, 2, 3, 50, 51, 9, 3, 60, 61, 1, 2, 3]
    assert p.propose(tokens) == [50, 51]             # [1 2 3] at 0, not the later lone [3] at 6


def test_proposer_limits_and_misses():
    p = NgramProposer(4, max_n=2, min_n=2)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert p.propose(tokens) == [3, 4, 5, 6]
    assert p.propose(tokens, limit=2) == [3, 4]
    assert p.propose(tokens, limit=0) == []
    assert p.propose([1, 2, 3, 4, 5]) == []           # no n-gram recurs
    assert p.propose([1, 2]) == []                    # too short to hold a match
    assert p.propose([1, 2, 1, 2]) == [1, 2]          # the continuation stops at the end of the context


def test_proposer_ignores_byte_matches_that_straddle_token_ids():
    # As int32 bytes, [256, 0] is 00 01 00 00 00 00 00 00: token 1 (01 00 00 00) appears at byte 1.
    p = NgramProposer(2, max_n=1, min_n=1)
    assert p.propose([256, 0, 5, 1]) == []
    assert p.propose([1, 9, 256, 0, 5, 1]) == [9, 256]   # the aligned match further back is found


def test_proposer_rejects_bad_settings():
    with pytest.raises(ValueError):
        NgramProposer(0, 3, 1)
    with pytest.raises(ValueError):
        NgramProposer(3, 1, 2)


def test_can_draft_only_position_independent_greedy_rows():
    assert can_draft(SamplingParams(temperature=0.0), 0)
    assert not can_draft(SamplingParams(temperature=0.7), 5)
    assert not can_draft(SamplingParams(temperature=0.0, logprobs=0), 5)
    assert not can_draft(SamplingParams(temperature=0.0, repetition_penalty=1.1), 5)
    assert not can_draft(SamplingParams(temperature=0.0, frequency_penalty=0.5), 5)
    assert not can_draft(SamplingParams(temperature=0.0, logit_bias={3: 1.0}), 5)
    assert not can_draft(SamplingParams(temperature=0.0, structured=object()), 5)
    assert not can_draft(SamplingParams(temperature=0.0, min_tokens=4), 3)
    assert can_draft(SamplingParams(temperature=0.0, min_tokens=4), 4)


# ---------------------------------------------------------------------------- the scheduler
def make(num_blocks: int = 64, block_size: int = 4, *, budget: int = 64, max_seqs: int = 8,
         spec: bool = True, k: int = 4, batch: int = 1, watermark: float = 0.0,
         max_model_len: int = 1024) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, watermark=watermark)
    conf = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, speculative_ngram=spec,
                           num_speculative_tokens=k, ngram_prompt_lookup_max=3, ngram_prompt_lookup_min=1,
                           speculative_disable_by_batch_size=batch)
    return Scheduler(conf, kv, max_model_len=max_model_len)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def req(rid: str, prompt: list[int], params: SamplingParams | None = None, **kw) -> Request:
    return Request(rid, list(prompt), params or greedy(), eos_token_ids=frozenset({EOS}), **kw)


class Driver:
    """schedule → echo model (verifies drafts through the block tables) → update, integrity each step."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.model = scripted_model.PagedSimModel(sched.kv.block_size, VOCAB, scripted_model.echo_next_token)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.final: dict[str, object] = {}
        self.drafted_steps = 0

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        assert out.num_batched_tokens == sum(x.num_tokens for x in out.seqs)
        self.drafted_steps += any(x.draft_token_ids for x in out.seqs)
        for ev in self.s.update(out, self.model.step(out)):
            assert ev.request_id not in self.final
            self.tokens[ev.request_id] += ev.new_token_ids
            if ev.finished:
                self.final[ev.request_id] = ev
        self.s.kv.check_integrity()
        return out

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished:
                return
            self.step()
        raise AssertionError("no progress")


def reference(prompt: list[int], params: SamplingParams, max_len: int = 1024) -> list[int]:
    return scripted_model.reference(prompt, params, None, max_len, vocab=VOCAB, eos=EOS,
                                    next_fn=scripted_model.echo_next_token)


PROMPT = [11, 12, 13, 14, 15, 16, 17] * 3


def test_a_decoder_runs_its_last_token_plus_drafts_and_pays_for_them():
    s = make()
    s.add_request(req("A", PROMPT, greedy(32)))
    d = Driver(s)
    d.step()                                    # prefill
    last = d.tokens["A"][-1]
    out = d.step()
    (seq,) = out.seqs
    assert seq.draft_token_ids and len(seq.draft_token_ids) <= 4
    assert seq.token_ids == [last] + seq.draft_token_ids
    assert seq.start_pos == len(PROMPT) and out.num_batched_tokens == 1 + len(seq.draft_token_ids)
    assert len(seq.block_table) * 4 >= seq.seq_len


def test_outputs_identical_with_and_without_drafts():
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10, 20] * 4 + [1, 2], list(range(30, 50))]
    on, off = {}, {}
    for i, p in enumerate(prompts):
        for spec, into in ((True, on), (False, off)):
            d = Driver(make(spec=spec))
            d.s.add_request(req(f"r{i}", p, greedy(40)))
            d.run()
            into.update(d.tokens)
            if spec:
                assert d.s.spec_num_accepted_tokens > 0
                assert d.s.spec_num_accepted_tokens < d.s.spec_num_draft_tokens   # some were rejected
                assert d.drafted_steps > 0
            else:
                assert d.drafted_steps == 0 and d.s.spec_num_draft_tokens == 0
            assert d.s.kv.stats().used_blocks == 0
    assert on == off == {f"r{i}": reference(p, greedy(40)) for i, p in enumerate(prompts)}


def test_drafting_turns_off_when_more_sequences_run():
    s = make(batch=1)
    d = Driver(s)
    s.add_request(req("A", PROMPT, greedy(20)))
    s.add_request(req("B", PROMPT[1:], greedy(20)))
    d.run()
    assert d.drafted_steps == 0
    s = make(batch=2)
    d = Driver(s)
    s.add_request(req("A", PROMPT, greedy(20)))
    s.add_request(req("B", PROMPT[1:], greedy(20)))
    d.run()
    assert d.drafted_steps > 0
    assert d.tokens["A"] == reference(PROMPT, greedy(20)) and d.tokens["B"] == reference(PROMPT[1:], greedy(20))


def test_no_drafts_for_rows_whose_next_token_rule_is_not_the_argmax():
    for params in (SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True),
                   greedy(20, logprobs=1), greedy(20, presence_penalty=0.5)):
        d = Driver(make())
        d.s.add_request(req("A", PROMPT, params))
        d.run()
        assert d.drafted_steps == 0


def _drafting_step(s: Scheduler, rid: str = "A") -> SchedulerOutput:
    """Prefill (sampling 11, which continues the prompt's cycle) and schedule the first drafted step."""
    out = s.schedule()
    s.update(out, RunnerOutput(out.step_id, sampled={rid: 11}))
    out = s.schedule()
    assert out.seqs[0].draft_token_ids == [12, 13, 14, 15]
    return out


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    s = make()
    s.add_request(req("A", PROMPT, greedy(32, stop_token_ids=[13])))
    out = _drafting_step(s)
    (ev,) = s.update(out, RunnerOutput(out.step_id, accepted={"A": [12, 13, 14, 15, 16]}))
    assert ev.new_token_ids == [12, 13] and ev.finished and ev.finish_reason is FinishReason.STOP
    assert s.kv.stats().used_blocks == 0
    s.kv.check_integrity()


def test_max_tokens_caps_drafts_and_ends_inside_a_run():
    s = make()
    s.add_request(req("A", PROMPT, greedy(4)))
    out = s.schedule()
    s.update(out, RunnerOutput(out.step_id, sampled={"A": 11}))
    out = s.schedule()
    assert out.seqs[0].draft_token_ids == [12, 13]             # 1 out, 3 to go: 2 drafts + the bonus
    (ev,) = s.update(out, RunnerOutput(out.step_id, accepted={"A": [12, 13, 14]}))
    assert ev.new_token_ids == [12, 13, 14] and ev.finish_reason is FinishReason.LENGTH
    s.kv.check_integrity()


def test_max_model_len_caps_drafts():
    s = make(max_model_len=len(PROMPT) + 3)
    s.add_request(req("A", PROMPT, greedy(3)))
    out = s.schedule()
    s.update(out, RunnerOutput(out.step_id, sampled={"A": 11}))
    out = s.schedule()
    assert out.seqs[0].seq_len <= len(PROMPT) + 3 and out.seqs[0].draft_token_ids == [12]


def test_rejected_drafts_give_back_their_blocks_and_are_overwritten():
    s = make(block_size=4)
    s.add_request(req("A", PROMPT, greedy(32)))
    out = _drafting_step(s)                   # positions 21..25: blocks up to index 6 (slots 24..27)
    assert len(out.seqs[0].block_table) == 7
    (ev,) = s.update(out, RunnerOutput(out.step_id, accepted={"A": [40]}))   # first draft rejected
    assert ev.new_token_ids == [40] and not ev.finished
    assert s.kv.num_computed_tokens("A") == len(PROMPT) + 1
    assert s.kv.num_allocated_slots("A") == 24                # the draft-only block went back
    s.kv.check_integrity()
    out = s.schedule()
    (seq,) = out.seqs
    assert seq.start_pos == len(PROMPT) + 1 and seq.token_ids[0] == 40   # rewrites the rejected slot
    assert s.spec_num_draft_tokens == 4 and s.spec_num_accepted_tokens == 0


def test_invalid_runner_tokens_end_the_request_with_an_error():
    s = make()
    s.add_request(req("A", PROMPT, greedy(32)))
    out = _drafting_step(s)
    (ev,) = s.update(out, RunnerOutput(out.step_id, accepted={"A": [12, 99, 14]}))   # 99 is not a draft
    assert ev.finish_reason is FinishReason.ERROR
    s.kv.check_integrity()
    assert s.kv.stats().used_blocks == 0


def test_a_runner_that_only_samples_is_taken_as_rejecting_every_draft():
    s = make()
    s.add_request(req("A", PROMPT, greedy(32)))
    out = _drafting_step(s)
    (ev,) = s.update(out, RunnerOutput(out.step_id, sampled={"A": 12}))
    assert ev.new_token_ids == [12] and s.kv.num_computed_tokens("A") == len(PROMPT) + 1
    s.kv.check_integrity()


def test_abort_with_drafts_in_flight():
    s = make()
    s.add_request(req("A", PROMPT, greedy(32)))
    out = _drafting_step(s)
    ev = s.finish_request("A")
    assert ev is not None and ev.finish_reason is FinishReason.ABORT
    assert s.update(out, RunnerOutput(out.step_id, accepted={"A": [12, 13, 14, 15, 16]})) == []
    s.kv.check_integrity()
    assert s.kv.stats().used_blocks == 0 and not s.has_unfinished


def test_drafts_never_take_blocks_that_are_not_free():
    # 8 blocks of 4: the 21-token prompt + 1 token fill 6; 4 drafts need a 7th, which would leave
    # fewer free than the watermark (2 blocks)
    s = make(num_blocks=8, block_size=4, watermark=0.2)
    s.add_request(req("A", PROMPT, greedy(8)))
    out = s.schedule()
    s.update(out, RunnerOutput(out.step_id, sampled={"A": 11}))
    out = s.schedule()
    assert out.seqs[0].draft_token_ids == [] and out.seqs[0].num_tokens == 1


def test_preemption_and_prefix_sharing_with_drafts_keep_outputs_identical():
    prompts = [PROMPT + [k] * (k + 1) for k in range(6)]
    d = Driver(make(num_blocks=24, block_size=4, budget=16, batch=8))
    for i, p in enumerate(prompts):
        d.s.add_request(req(f"r{i}", p, greedy(24, ignore_eos=False)))
    d.run()
    assert d.s.num_preemptions > 0 and d.s.spec_num_accepted_tokens > 0
    assert dict(d.tokens) == {f"r{i}": reference(p, greedy(24, ignore_eos=False)) for i, p in enumerate(prompts)}
    assert d.s.kv.stats().used_blocks == 0
