"""StepCost (what decode steps and prompt chunks take, learned from timed steps) and the scheduler's
time-sized prompt chunks beside decoders, with a scripted runner whose steps take a known time."""
from __future__ import annotations

import random

import pytest

from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
from chatserve.core.request import FinishReason, SamplingParams
from chatserve.core.step_cost import StepCost, prompt_work

from test_scheduler import Driver, make, plan, reference, req

PARAMS = SamplingParams(max_tokens=1)
# the "true" cost of the scripted steps: a decode step, then a chunk's fixed, per-token and per-key parts
DECODE_S, C_FIXED, C_TOK, C_ATTN = 0.020, 0.004, 0.0015, 0.4e-6


def seq(rid: str, n: int, start: int) -> ScheduledSeq:
    return ScheduledSeq(rid, [1] * n, start, [], True, PARAMS, [1] * (start + n))


def true_seconds(out: SchedulerOutput) -> float:
    """What the scripted runner's step takes: the decoders' step, plus each prompt chunk's work."""
    t = 0.0
    chunks = [s for s in out.seqs if len(s.token_ids) > 1]
    if len(chunks) < len(out.seqs):
        t += DECODE_S
    if chunks:
        t += C_FIXED
    for s in chunks:
        n = len(s.token_ids)
        t += n * (C_TOK + C_ATTN * (s.start_pos + n / 2))
    return t


def test_prompt_work_splits_decode_rows_from_chunks():
    out = SchedulerOutput(1, [seq("d", 1, 100), seq("p", 64, 1024)])
    rows, tokens, attn = prompt_work(out)
    assert (rows, tokens) == (1, 64)
    assert attn == pytest.approx(64 * (1024 + 32) / 1024)


def test_fit_recovers_the_cost_of_chunks_at_every_position():
    cost = StepCost()
    assert not cost.ready
    cost.observe(SchedulerOutput(1, [seq("d", 1, 50)]), DECODE_S)
    assert cost.decode_s == pytest.approx(DECODE_S)
    rng = random.Random(0)
    for step in range(40):
        out = SchedulerOutput(step, [seq("d", 1, 50), seq("p", rng.randint(16, 256), rng.randint(0, 4000))])
        cost.observe(out, true_seconds(out))
    assert cost.ready
    c0, c1, c2 = cost.coef
    assert c0 == pytest.approx(C_FIXED, rel=1e-3) and c1 == pytest.approx(C_TOK, rel=1e-3)
    assert c2 == pytest.approx(C_ATTN * 1024, rel=1e-3)   # fitted per 1,024 token·keys
    for start in (0, 1000, 4000):
        n = cost.prompt_tokens_within(2 * DECODE_S, start)
        assert n > 0
        assert cost.prompt_seconds(n, start) <= 2 * DECODE_S < cost.prompt_seconds(n + 1, start)
    # later chunks attend to more keys: fewer of their tokens fit in the same time
    assert cost.prompt_tokens_within(0.04, 4000) < cost.prompt_tokens_within(0.04, 0)
    assert cost.prompt_tokens_within(C_FIXED / 2, 0) == 0


def test_one_stalled_step_moves_the_fit_within_bounds():
    """A step that a busy host stalled 50× counts as at most 2× its prediction: the chunks after it
    shrink for a while, and come back as normal steps follow."""
    cost = StepCost()
    cost.observe(SchedulerOutput(1, [seq("d", 1, 50)]), DECODE_S)
    rng = random.Random(1)
    for step in range(40):
        out = SchedulerOutput(step, [seq("d", 1, 50), seq("p", rng.randint(16, 256), rng.randint(0, 4000))])
        cost.observe(out, true_seconds(out))
    before = cost.prompt_tokens_within(2 * DECODE_S, 1000)
    out = SchedulerOutput(99, [seq("d", 1, 50), seq("p", 32, 1000)])
    cost.observe(out, 50 * true_seconds(out))
    assert cost.prompt_tokens_within(2 * DECODE_S, 1000) < before
    for step in range(100, 120):
        out = SchedulerOutput(step, [seq("d", 1, 50), seq("p", rng.randint(16, 256), rng.randint(0, 4000))])
        cost.observe(out, true_seconds(out))
    assert abs(cost.prompt_tokens_within(2 * DECODE_S, 1000) - before) <= 1


def test_chunks_at_one_position_fall_back_to_fewer_terms():
    """All chunks of one length at one position cannot separate the three terms: the fit keeps what it
    can and still predicts those chunks."""
    cost = StepCost()
    cost.observe(SchedulerOutput(1, [seq("d", 1, 50)]), DECODE_S)
    for step in range(5):
        out = SchedulerOutput(step, [seq("d", 1, 50), seq("p", 32, 0)])
        cost.observe(out, true_seconds(out))
    assert cost.ready and all(c >= 0 for c in cost.coef)
    assert cost.prompt_seconds(32, 0) == pytest.approx(true_seconds(SchedulerOutput(0, [seq("p", 32, 0)])))


def test_decode_estimate_follows_recent_steps_and_untimed_steps_are_ignored():
    cost = StepCost()
    for _ in range(30):
        cost.observe(SchedulerOutput(1, [seq("d", 1, 50)]), 0.010)
    for _ in range(30):
        cost.observe(SchedulerOutput(1, [seq("d", 1, 50), seq("e", 1, 60)]), 0.030)
    assert cost.decode_s == pytest.approx(0.030, rel=1e-2)
    cost.observe(SchedulerOutput(1, [seq("p", 64, 0)]), 0.0)
    assert cost.num_prompt_steps == 0


class TimedDriver(Driver):
    """Driver whose runner reports the scripted step time (true_seconds) as its wall time."""

    def __init__(self, sched) -> None:
        super().__init__(sched)
        run = self.model.step

        def timed(out: SchedulerOutput, errors=None):
            res = run(out, errors)
            res.elapsed_s = true_seconds(out)
            return res

        self.model.step = timed


def _long_prompt_beside_decoders(share: float) -> tuple[TimedDriver, list[SchedulerOutput]]:
    s = make(num_blocks=2048, block_size=16, budget=512, max_model_len=8192, prefill_time_while_decoding=share)
    d = TimedDriver(s)
    s.add_request(req("warm", list(range(1, 600)), max_tokens=2))   # timed prompt chunks, then a decode
    d.run()
    for i in range(3):
        s.add_request(req(f"D{i}", [5, 6, 7], max_tokens=400))
    d.step()
    d.step()                                                          # decode-only steps are timed
    s.add_request(req("L", [(7 * i) % 60 + 1 for i in range(3000)], max_tokens=3))
    outs = []
    while s.get_request("L") is not None and s.get_request("L").num_computed_tokens < 3000:
        outs.append(d.step())
    return d, outs


def test_a_long_prompt_beside_decoders_gets_chunks_sized_by_time():
    d, outs = _long_prompt_beside_decoders(2.0)
    chunks = [(x.start_pos, x.num_tokens) for out in outs for x in out.seqs if x.request_id == "L"]
    assert sum(n for _, n in chunks) == 3000 and len(chunks) > 10
    decoders = [x for out in outs for x in out.seqs if x.request_id.startswith("D")]
    assert len(decoders) == 3 * len(outs)            # every step kept the decoders' tokens
    # the decoders' step + at most 2 of its time in prompt work, or (late, when 16 tokens over ~3,000 keys
    # cost more) one block: a prompt always moves on
    for out in outs[:-1]:                            # (the last chunk is what was left)
        n = sum(x.num_tokens for x in out.seqs if x.request_id == "L")
        assert true_seconds(out) <= 3.0001 * DECODE_S or n == 16
    assert sum(true_seconds(o) <= 3.0001 * DECODE_S for o in outs) > len(outs) / 2
    # every 64 steps with prompt work, one without: what the decoders take alone is timed again
    alone = [i for i, o in enumerate(outs) if not any(x.request_id == "L" for x in o.seqs)]
    assert alone and all(b - a == 65 for a, b in zip(alone, alone[1:]))
    first, last = chunks[0][1], chunks[-2][1]
    assert first > last >= 16                        # more keys later: shorter chunks, never below a block
    d.run()
    assert d.final["L"].finish_reason is FinishReason.LENGTH
    assert d.tokens["L"] == reference([(7 * i) % 60 + 1 for i in range(3000)],
                                      SamplingParams(max_tokens=3, ignore_eos=True), None, 8192)


def test_a_prompt_within_one_budget_goes_in_one_step_beside_decoders():
    """Slicing a prompt that one step can finish would pay a mixed step's fixed part per slice: it
    runs whole (one pause), where a longer one beside the same decoders is sliced."""
    d, _ = _long_prompt_beside_decoders(2.0)
    s = d.s
    assert s.step_cost.ready and s.num_running >= 3
    s.add_request(req("S", list(range(2000, 2300)), max_tokens=2))  # 300 tokens, budget 512
    assert [(x.request_id, x.num_tokens) for x in d.step().seqs if x.request_id == "S"] == [("S", 300)]
    s.add_request(req("M", list(range(3000, 3600)), max_tokens=2))  # 600 tokens: sliced
    chunk = [x.num_tokens for x in d.step().seqs if x.request_id == "M"]
    assert chunk and 16 <= chunk[0] < 300


def test_long_prompts_outnumbering_the_decoders_go_at_full_speed():
    """One decoder beside two long prompts: the step's time goes to the prompts (slices would halve their
    throughput for one stream's ITL); once decoders are as many as prompts, the slices come back."""
    s = make(num_blocks=2048, block_size=16, budget=512, max_model_len=8192)
    d = TimedDriver(s)
    s.add_request(req("warm", list(range(1, 600)), max_tokens=2))
    d.run()
    s.add_request(req("D0", [5, 6, 7], max_tokens=400))
    d.step()
    d.step()                                                          # a decode-only step, timed
    s.add_request(req("A", list(range(1000, 2500)), max_tokens=3))    # two 1,500-token prompts
    s.add_request(req("B", list(range(3000, 4500)), max_tokens=3))
    plans = [[(x.request_id, x.num_tokens) for x in d.step().seqs] for _ in range(3)]
    assert plans[0] == [("D0", 1), ("A", 511)] and plans[1] == [("D0", 1), ("A", 511)]
    # A decodes from here: two decoders, one prompt (B), and B is sliced
    assert plans[2] == [("D0", 1), ("A", 478), ("B", 33)]
    b = [x.num_tokens for x in d.step().seqs if x.request_id == "B"]
    assert b and 16 <= b[0] < 300


def test_time_limit_zero_keeps_the_whole_budget():
    _, outs = _long_prompt_beside_decoders(0.0)
    chunks = [x.num_tokens for out in outs for x in out.seqs if x.request_id == "L"]
    assert chunks[:5] == [512 - 3] * 5               # the budget less one token per decoder


def test_untimed_runner_keeps_the_token_schedule():
    """Scripted runners that report no time (elapsed_s None) schedule exactly as before."""
    s = make(budget=8)
    for rid, n in (("A", 5), ("B", 6)):
        s.add_request(req(rid, range(10, 10 + n)))
    d = Driver(s)
    d.step()
    assert not s.step_cost.ready
    assert plan(d.step()) == [("A", 5, 1, True), ("B", 3, 3, True)]

