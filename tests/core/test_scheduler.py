"""Scheduler behaviour with scripted runner outputs: exact schedules, prefix hits, preemption, n > 1,
admission control, stops and aborts, and output equivalence under a paged stand-in model (no torch).
"""
from __future__ import annotations

from collections import defaultdict

import pytest

from chatserve.config import SchedulerConfig
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import FinishReason, Request, RequestStatus, SamplingParams
from chatserve.core.errors import ErrorCode
from chatserve.core.scheduler import AdmissionError, Scheduler

import scripted_model

VOCAB = 64
EOS = 0


def next_token(ctx: tuple[int, ...], seed: int | None) -> int:
    return scripted_model.next_token(ctx, seed, VOCAB)


def reference(prompt: list[int], params: SamplingParams, seed: int | None, max_len: int) -> list[int]:
    return scripted_model.reference(prompt, params, seed, max_len, vocab=VOCAB, eos=EOS)


def make(num_blocks: int = 64, block_size: int = 4, *, budget: int = 64, max_seqs: int = 8,
         prefix: bool = True, watermark: float = 0.0, max_model_len: int = 1024,
         **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=watermark)
    conf = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **cfg)
    return Scheduler(conf, kv, max_model_len=max_model_len)


def req(rid: str, prompt: list[int], max_tokens: int = 8, **kw) -> Request:
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens,
                                                      ignore_eos=kw.pop("ignore_eos", True),
                                                      seed=kw.pop("seed", None))
    return Request(rid, list(prompt), params, eos_token_ids=frozenset({EOS}), **kw)


def group(gid: str, prompt: list[int], n: int, max_tokens: int = 4, seed: int | None = None,
          ignore_eos: bool = True) -> list[Request]:
    return [Request(f"{gid}.{i}", list(prompt),
                    SamplingParams(n=n, max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos),
                    eos_token_ids=frozenset({EOS}), group_id=gid, sample_index=i)
            for i in range(n)]


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.seqs]


class Driver:
    """schedule → simulated model → update, checking integrity and collecting events."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.model = scripted_model.PagedSimModel(sched.kv.block_size, VOCAB)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.final: dict[str, object] = {}
        self.steps = 0

    def step(self, errors: dict[str, str] | None = None) -> SchedulerOutput:
        out = self.s.schedule()
        for ev in self.s.update(out, self.model.step(out, errors)):
            self.record(ev)
        self.s.kv.check_integrity()
        self.steps += 1
        return out

    def record(self, ev) -> None:
        assert ev.request_id not in self.final, f"{ev.request_id} ended twice"
        self.tokens[ev.request_id] += ev.new_token_ids
        if ev.finished:
            self.final[ev.request_id] = ev

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT):
        ev = self.s.finish_request(rid, reason)
        if ev is not None:
            self.record(ev)
        return ev

    def run(self, max_steps: int = 10_000) -> None:
        while self.s.has_unfinished:
            self.step()
            assert self.steps < max_steps, "no progress"


# ---------------------------------------------------------------------------- exact schedules
def test_budget_is_split_between_prefills_and_decodes():
    s = make(budget=8)
    for rid, n in (("A", 5), ("B", 6), ("C", 3)):
        s.add_request(req(rid, range(10, 10 + n)))
    d = Driver(s)
    out = d.step()
    assert plan(out) == [("A", 0, 5, True), ("B", 0, 3, False)]
    assert out.num_batched_tokens == 8
    out = d.step()
    assert plan(out) == [("A", 5, 1, True), ("B", 3, 3, True), ("C", 0, 3, True)]
    assert out.num_batched_tokens == 7
    out = d.step()
    assert plan(out) == [("A", 6, 1, True), ("B", 6, 1, True), ("C", 3, 1, True)]
    assert s.num_running == 3 and s.num_waiting == 0


def test_max_num_seqs_caps_running():
    s = make(budget=64, max_seqs=2)
    for rid in "ABC":
        s.add_request(req(rid, [1, 2, 3], max_tokens=2))
    d = Driver(s)
    assert [p[0] for p in plan(d.step())] == ["A", "B"]
    assert s.num_waiting == 1
    d.step()                      # A and B sample their 2nd token and finish
    out = d.step()
    assert plan(out) == [("C", 0, 3, True)]
    assert sorted(out.finished_ids) == ["A", "B"]


def test_chunked_prefill_interleaves_with_decodes():
    s = make(budget=10)
    s.add_request(req("D1", [1, 2], max_tokens=20))
    s.add_request(req("D2", [3, 4], max_tokens=20))
    d = Driver(s)
    d.step()
    s.add_request(req("L", list(range(100, 140)), max_tokens=4))   # 40-token prompt
    plans = [plan(d.step()) for _ in range(6)]
    for k in range(5):
        assert plans[k][:2] == [("D1", 2 + k, 1, True), ("D2", 2 + k, 1, True)]
        assert plans[k][2] == ("L", 8 * k, 8, k == 4)
    assert plans[5] == [("D1", 7, 1, True), ("D2", 7, 1, True), ("L", 40, 1, True)]


def test_prefill_chunk_leaves_one_token_for_each_later_decoder():
    s = make(budget=10)
    s.add_request(req("B", [1, 2], max_tokens=20, priority=1))
    d = Driver(s)
    d.step()
    s.add_request(req("A", list(range(50, 80)), max_tokens=2, priority=0))  # served before B
    assert plan(d.step()) == [("B", 2, 1, True), ("A", 0, 9, False)]
    assert plan(d.step()) == [("A", 9, 9, False), ("B", 3, 1, True)]
    assert plan(d.step()) == [("A", 18, 9, False), ("B", 4, 1, True)]
    assert plan(d.step()) == [("A", 27, 3, True), ("B", 5, 1, True)]


def test_prefill_cap_applies_only_while_others_decode():
    s = make(num_blocks=128, budget=64, prefill_tokens_while_decoding=8)
    s.add_request(req("D1", [1, 2], max_tokens=4))
    s.add_request(req("D2", [3, 4], max_tokens=4))
    d = Driver(s)
    d.step()                                                        # both prompts, one step
    s.add_request(req("L", list(range(100, 300)), max_tokens=3))   # 200-token prompt
    plans = [plan(d.step()) for _ in range(3)]                      # D1, D2 sample tokens 2..4
    for k in range(3):
        assert plans[k] == [("D1", 2 + k, 1, True), ("D2", 2 + k, 1, True), ("L", 8 * k, 8, False)]
    assert s.get_request("D1") is None and s.get_request("D2") is None   # finished at 4 tokens
    out = d.step()                                                  # alone: the whole budget
    assert plan(out) == [("L", 24, 64, False)]
    d.run()
    assert d.final["L"].finish_reason is FinishReason.LENGTH
    assert d.tokens["L"] == reference(list(range(100, 300)), SamplingParams(max_tokens=3, ignore_eos=True),
                                      None, 1024)


def test_prefill_cap_binds_a_running_prompt_once_a_decoder_joins():
    s = make(num_blocks=128, budget=64, prefill_tokens_while_decoding=8)
    s.add_request(req("A", list(range(10, 80)), max_tokens=20))    # 70-token prompt
    s.add_request(req("L", list(range(100, 300)), max_tokens=2))   # 200-token prompt
    d = Driver(s)
    assert plan(d.step()) == [("A", 0, 64, False)]                 # nothing decodes yet
    assert plan(d.step()) == [("A", 64, 6, True), ("L", 0, 58, False)]
    # from now on A decodes: L's chunks stay within the cap
    assert plan(d.step()) == [("A", 70, 1, True), ("L", 58, 8, False)]
    assert plan(d.step()) == [("A", 71, 1, True), ("L", 66, 8, False)]
    d.run()
    assert set(d.final) == {"A", "L"} and len(d.tokens["L"]) == 2 and len(d.tokens["A"]) == 20


def test_prefill_cap_is_shared_by_the_prompts_of_one_step():
    s = make(num_blocks=128, budget=64, prefill_tokens_while_decoding=10)
    s.add_request(req("D", [1, 2], max_tokens=20))
    d = Driver(s)
    d.step()
    s.add_request(req("A", list(range(100, 106))))                  # 6-token prompt
    s.add_request(req("B", list(range(200, 230))))                  # 30-token prompt
    assert plan(d.step()) == [("D", 2, 1, True), ("A", 0, 6, True), ("B", 0, 4, False)]
    assert plan(d.step()) == [("D", 3, 1, True), ("A", 6, 1, True), ("B", 4, 10, False)]


def test_prefill_cap_zero_keeps_the_whole_budget():
    s = make(budget=10, prefill_tokens_while_decoding=0)
    s.add_request(req("D", [1, 2], max_tokens=20))
    d = Driver(s)
    d.step()
    s.add_request(req("L", list(range(100, 140))))
    assert plan(d.step()) == [("D", 2, 1, True), ("L", 0, 9, False)]


# ---------------------------------------------------------------------------- prefix cache
def test_prefix_hits_skip_computed_tokens():
    s = make(block_size=4)
    d = Driver(s)
    prompt = list(range(1, 11))                       # 10 tokens: 2 full blocks + 2
    s.add_request(req("R1", prompt, max_tokens=3))
    d.run()
    assert s.kv.stats().prefix_hits == 0
    s.add_request(req("R2", prompt + [60, 61], max_tokens=3))
    out = d.step()
    assert plan(out) == [("R2", 8, 4, True)]          # blocks [1..4] and [5..8] were cached
    assert s.get_request("R2").num_cached_tokens == 8
    d.run()
    assert d.final["R2"].num_cached_tokens == 8 and d.final["R2"].num_prompt_tokens == 12
    s.add_request(req("R3", prompt, max_tokens=3))    # identical prompt: still computes 2 tokens
    assert plan(d.step()) == [("R3", 8, 2, True)]
    d.run()
    assert d.tokens["R3"] == d.tokens["R1"] == reference(prompt, SamplingParams(max_tokens=3,
                                                          ignore_eos=True), None, 1024)
    assert s.kv.stats().prefix_hits == 16


def test_no_prefix_caching_computes_everything():
    s = make(block_size=4, prefix=False)
    d = Driver(s)
    prompt = list(range(1, 11))
    s.add_request(req("R1", prompt, max_tokens=3))
    d.run()
    s.add_request(req("R2", prompt, max_tokens=3))
    assert plan(d.step()) == [("R2", 0, 10, True)]
    d.run()
    assert d.final["R2"].num_cached_tokens == 0
    assert d.tokens["R2"] == d.tokens["R1"]


# ---------------------------------------------------------------------------- preemption
def test_preemption_takes_latest_arrival_and_resumes_it_first():
    # 6 blocks of 4; each request grows to 12 tokens (3 blocks): three cannot all fit.
    s = make(num_blocks=6, block_size=4)
    d = Driver(s)
    for rid, base in (("A", 10), ("B", 20), ("C", 30)):
        s.add_request(req(rid, range(base, base + 4), max_tokens=8))
    outs = []
    while s.num_preemptions == 0:
        outs.append(plan(d.step()))
    assert len(outs) == 6                       # steps 1-5 fill 6 blocks; step 6 needs 3 more
    assert outs[-1] == [("A", 8, 1, True), ("B", 8, 1, True)]
    c = s.get_request("C")
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_waiting == 1 and s.num_running == 2
    assert not s.kv.has_seq("C")
    n_before = len(d.tokens["C"])
    s.add_request(req("D", range(40, 44), max_tokens=2))   # arrives later: queues behind C
    while True:
        out = d.step()
        if any(p[0] == "C" for p in plan(out)):
            break
        assert all(p[0] != "D" for p in plan(out))
    resumed = next(p for p in plan(out) if p[0] == "C")
    # C recomputes its prompt + every output except the newest (prefix hits may skip whole blocks)
    assert resumed[1] % 4 == 0 and resumed[1] + resumed[2] == 4 + n_before and resumed[3]
    d.run()
    for rid, base in (("A", 10), ("B", 20), ("C", 30)):
        assert d.tokens[rid] == reference(list(range(base, base + 4)),
                                          SamplingParams(max_tokens=8, ignore_eos=True), None, 1024)
    assert s.kv.stats().used_blocks == 0


def test_preemption_victim_is_lowest_priority_first():
    s = make(num_blocks=6, block_size=4)
    d = Driver(s)
    s.add_request(req("LOW", range(10, 14), max_tokens=8, priority=5))   # arrives first
    s.add_request(req("HI1", range(20, 24), max_tokens=8, priority=0))
    s.add_request(req("HI2", range(30, 34), max_tokens=8, priority=0))
    while s.num_preemptions == 0:
        d.step()
    assert s.get_request("LOW").status is RequestStatus.PREEMPTED
    assert s.get_request("HI1").status is s.get_request("HI2").status is RequestStatus.RUNNING
    d.run()
    assert set(d.final) == {"LOW", "HI1", "HI2"}


def test_running_request_alone_never_starves_on_a_cache_it_fits():
    # One request needing exactly the whole cache, watermark on: admitted anyway when idle.
    s = make(num_blocks=4, block_size=4, watermark=0.25)
    d = Driver(s)
    s.add_request(req("X", range(1, 9), max_tokens=8))
    d.run(max_steps=20)
    assert d.final["X"].finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------------------- n > 1
def test_n8_prefills_once_and_shares_prompt_blocks():
    s = make(num_blocks=64, block_size=4)
    d = Driver(s)
    prompt = list(range(1, 11))                       # 10 tokens → 9 shared, last one per sample
    s.add_group(group("g", prompt, 8, max_tokens=3, seed=100))
    assert s.num_waiting == 8
    out = d.step()
    assert plan(out) == [("g.0", 0, 9, False)]
    assert s.num_running == 8 and s.num_waiting == 0
    assert s.kv.stats().used_blocks == 3
    out = d.step()
    assert plan(out) == [(f"g.{i}", 9, 1, True) for i in range(8)]
    assert [x.seed for x in out.seqs] == list(range(100, 108))
    assert len(out.copy_ops) == 7 and len({op.src for op in out.copy_ops}) == 1
    st = s.kv.stats()
    assert st.used_blocks == 2 + 8                   # two shared full blocks + one own block each
    assert st.cow_copies == 7
    d.run()
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(8):
        assert d.tokens[f"g.{i}"] == reference(prompt, p, 100 + i, 1024)
    assert len({tuple(d.tokens[f"g.{i}"]) for i in range(8)}) > 1
    assert s.kv.stats().used_blocks == 0


def test_n_forks_at_admission_when_prompt_is_cached():
    s = make(block_size=4)
    d = Driver(s)
    prompt = list(range(1, 10))                       # 9 tokens: prompt[:-1] is 2 full blocks
    s.add_request(req("warm", prompt, max_tokens=1))
    d.run()
    s.add_group(group("g", prompt, 4, max_tokens=2, seed=7))
    out = d.step()
    assert plan(out) == [(f"g.{i}", 8, 1, True) for i in range(4)]
    assert out.copy_ops == []
    assert all(d.s.get_request(f"g.{i}").num_cached_tokens == 8 for i in range(4))
    d.run()
    for i in range(4):
        assert d.tokens[f"g.{i}"] == reference(prompt, SamplingParams(max_tokens=2, ignore_eos=True),
                                               7 + i, 1024)


def test_n_with_one_token_prompt():
    s = make(block_size=4)
    d = Driver(s)
    s.add_group(group("g", [5], 3, max_tokens=2, seed=1))
    assert plan(d.step()) == [("g.0", 0, 1, True), ("g.1", 0, 1, True), ("g.2", 0, 1, True)]
    d.run()
    assert set(d.final) == {"g.0", "g.1", "g.2"}


def test_aborting_a_sibling_ends_only_that_sibling():
    s = make(block_size=4)
    d = Driver(s)
    s.add_group(group("g", list(range(1, 11)), 4, max_tokens=5, seed=3))
    d.step()
    d.step()
    ev = d.abort("g.2")
    assert ev.finished and ev.finish_reason is FinishReason.ABORT
    assert s.finish_request("g.2") is None
    d.run()
    assert {k: v.finish_reason for k, v in d.final.items()} == {
        "g.0": FinishReason.LENGTH, "g.1": FinishReason.LENGTH, "g.2": FinishReason.ABORT,
        "g.3": FinishReason.LENGTH}
    assert [len(d.tokens[f"g.{i}"]) for i in range(4)] == [5, 5, 1, 5]


def test_aborting_the_leader_before_the_fork_hands_over_the_group():
    s = make(block_size=4, budget=4)
    d = Driver(s)
    prompt = list(range(1, 14))                       # 13 tokens: 3 chunks of 4 before the fork
    s.add_group(group("g", prompt, 3, max_tokens=3, seed=9))
    assert plan(d.step()) == [("g.0", 0, 4, False)]
    d.step()
    d.abort("g.0")
    assert s.num_running == 0 and s.num_waiting == 2
    out = d.step()
    assert plan(out) == [("g.1", 8, 4, False)]        # the heir hits the 2 committed blocks
    assert out.finished_ids == ["g.0"]
    d.abort("g.2")                                    # a pending sibling: just removed
    d.run()
    assert d.tokens["g.1"] == reference(prompt, SamplingParams(max_tokens=3, ignore_eos=True), 10, 1024)
    assert set(d.final) == {"g.0", "g.1", "g.2"}
    assert s.kv.stats().used_blocks == 0


# ---------------------------------------------------------------------------- admission control
def test_admission_refuses_what_can_never_fit():
    s = make(num_blocks=8, block_size=4, max_model_len=40, max_seqs=4)
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("a", range(30), max_tokens=11))
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "context length" in e.value.message
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("b", range(30), max_tokens=4))        # 34 tokens = 9 blocks > 8
    assert e.value.code is ErrorCode.INVALID_VALUE and e.value.retry_after is None
    with pytest.raises(AdmissionError) as e:
        s.add_group(group("g", [1, 2], 5))
    assert e.value.code is ErrorCode.INVALID_VALUE
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("c", []))
    assert e.value.code is ErrorCode.INVALID_VALUE
    assert not s.has_unfinished


def test_admission_bounds_the_waiting_queue():
    s = make(max_waiting_requests=3, max_waiting_tokens=100)
    s.add_request(req("a", range(10)))
    s.add_group(group("g", range(10), 2))
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("b", range(10)))
    assert e.value.code is ErrorCode.SERVER_OVERLOADED and e.value.retry_after >= 1.0
    with pytest.raises(AdmissionError):
        s.add_group(group("h", range(5), 2))                   # refused as a whole
    assert s.get_request("h.0") is None and s.get_request("h.1") is None
    assert s.num_waiting == 3
    Driver(s).step()                                           # the queue drains into running
    s.add_request(req("b", range(90)))
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("c", range(20)))                     # 110 queued tokens > 100
    assert e.value.code is ErrorCode.SERVER_OVERLOADED
    s2 = make(max_waiting_tokens=10)
    s2.add_request(req("big", range(50)))                      # an empty queue always accepts


def test_duplicate_ids_are_a_programming_error():
    s = make()
    s.add_request(req("a", [1, 2]))
    with pytest.raises(ValueError):
        s.add_request(req("a", [1, 2]))


# ---------------------------------------------------------------------------- stops, aborts, errors
def _first_token(prompt: list[int]) -> int:
    return next_token(tuple(prompt), None)


def test_stop_conditions():
    prompt = [7, 8, 9]
    t0 = _first_token(prompt)
    s = make(max_model_len=6)
    d = Driver(s)
    eos_req = Request("eos", prompt, SamplingParams(max_tokens=3), eos_token_ids=frozenset({t0}))
    ign_req = Request("ign", prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                      eos_token_ids=frozenset({t0}))
    stop_req = Request("stop", prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                      stop_token_ids=[t0]))
    len_req = Request("len", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    ctx_req = Request("ctx", [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    for r in (eos_req, ign_req, stop_req, len_req, ctx_req):
        s.add_request(r)
    d.run()
    f = {k: (v.finish_reason, len(d.tokens[k])) for k, v in d.final.items()}
    assert f == {"eos": (FinishReason.STOP, 1), "ign": (FinishReason.LENGTH, 3),
                 "stop": (FinishReason.STOP, 1), "len": (FinishReason.LENGTH, 2),
                 "ctx": (FinishReason.LENGTH, 2)}
    assert d.final["eos"].new_token_ids == [t0] and d.final["eos"].num_prompt_tokens == 3


def test_max_model_len_stops_generation():
    s = make(max_model_len=8, block_size=4)
    d = Driver(s)
    s.add_request(req("a", range(1, 6), max_tokens=3))
    s.get_request("a").params.max_tokens = 10          # bypass the admission check on purpose
    d.run()
    assert d.final["a"].finish_reason is FinishReason.LENGTH and len(d.tokens["a"]) == 3


def test_abort_frees_blocks_at_once_and_is_reported_to_the_runner():
    s = make(block_size=4)
    d = Driver(s)
    s.add_request(req("a", range(1, 20), max_tokens=50))
    s.add_request(req("w", range(1, 3)))
    d.step()
    assert s.kv.stats().used_blocks > 0
    ev = s.finish_request("a")
    assert ev.finish_reason is FinishReason.ABORT and ev.num_prompt_tokens == 19
    s.finish_request("w")
    assert s.kv.stats().used_blocks == 0 and not s.has_unfinished
    assert s.get_request("a") is None
    assert sorted(s.schedule().finished_ids) == ["a", "w"]


def test_abort_between_schedule_and_update():
    s = make(block_size=4)
    model = scripted_model.PagedSimModel(4, VOCAB)
    s.add_request(req("a", range(1, 6)))
    s.add_request(req("b", range(1, 6)))
    out = s.schedule()
    s.finish_request("a")
    evs = s.update(out, model.step(out))
    assert [e.request_id for e in evs] == ["b"]
    s.kv.check_integrity()


def test_stop_string_finish_uses_given_reason():
    s = make()
    d = Driver(s)
    s.add_request(req("a", [1, 2, 3], max_tokens=10))
    d.step()
    ev = s.finish_request("a", FinishReason.STOP)
    assert ev.finish_reason is FinishReason.STOP and s.kv.stats().used_blocks == 0


def test_runner_error_ends_only_that_request():
    s = make()
    d = Driver(s)
    s.add_request(req("a", [1, 2, 3]))
    s.add_request(req("b", [4, 5, 6], max_tokens=2))
    d.step(errors={"a": "nan in logits"})
    assert d.final["a"].finish_reason is FinishReason.ERROR and d.final["a"].error == "nan in logits"
    d.run()
    assert d.final["b"].finish_reason is FinishReason.LENGTH
    assert s.kv.stats().used_blocks == 0


def test_events_carry_logprobs():
    from chatserve.core.outputs import TokenLogprob

    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=1))
    out = s.schedule()
    lp = TokenLogprob(5, -0.1, [(5, -0.1)])
    (ev,) = s.update(out, RunnerOutput(out.step_id, sampled={"a": 5}, logprobs={"a": lp}))
    assert ev.new_token_ids == [5] and ev.logprobs == [lp] and ev.finished


# ---------------------------------------------------------------------------- equivalence
SYSTEM = list(range(40, 52))                           # a 12-token shared "system prompt"


def _workload() -> list[list[Request]]:
    groups = []
    for k in range(8):
        prompt = SYSTEM + [k + 1] * (3 + k)
        if k % 3 == 2:
            groups.append(group(f"g{k}", prompt, 2, max_tokens=16, seed=k, ignore_eos=False))
        else:
            groups.append([req(f"r{k}", prompt, max_tokens=16, ignore_eos=False)])
    return groups


def _run_batch(sched: Scheduler, groups: list[list[Request]]) -> Driver:
    d = Driver(sched)
    for g in groups:
        sched.add_group(g)
    d.run()
    return d


def _expected() -> dict[str, list[int]]:
    exp = {}
    for g in _workload():
        for r in g:
            seed = None if r.params.seed is None else r.params.seed + r.sample_index
            exp[r.request_id] = reference(r.prompt_token_ids, r.params, seed, 1024)
    return exp


def test_outputs_identical_with_and_without_prefix_caching():
    on = _run_batch(make(block_size=4), _workload())
    off = _run_batch(make(block_size=4, prefix=False), _workload())
    assert on.s.kv.stats().prefix_hits > 0 and off.s.kv.stats().prefix_hits == 0
    assert dict(on.tokens) == dict(off.tokens) == _expected()


def test_outputs_identical_under_preemption():
    tiny = _run_batch(make(num_blocks=12, block_size=4, budget=16), _workload())
    assert tiny.s.num_preemptions > 0
    assert dict(tiny.tokens) == _expected()
    assert tiny.s.kv.stats().used_blocks == 0


def test_outputs_identical_alone_and_in_a_batch_of_8():
    batch = _run_batch(make(block_size=4, budget=16), _workload())
    alone: dict[str, list[int]] = {}
    for g in _workload():
        alone.update(_run_batch(make(block_size=4, budget=16), [g]).tokens)
    assert dict(batch.tokens) == alone == _expected()


def test_issue_scenario_48_blocks_eight_long_requests_all_finish():
    # `serve --kv-blocks 48 --max-num-seqs 16`: 8 × (250-token prompt + 96 tokens, ignore_eos).
    kv = KVCacheManager(48, 16, watermark=0.01)
    s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512), kv,
                  max_model_len=2048)
    d = Driver(s)
    for k in range(8):
        s.add_request(req(f"c{k}", [1 + k] + list(range(100, 349)), max_tokens=96))
    d.run(max_steps=5000)
    assert all(d.final[f"c{k}"].finish_reason is FinishReason.LENGTH for k in range(8))
    p = SamplingParams(max_tokens=96, ignore_eos=True)
    assert all(d.tokens[f"c{k}"] == reference([1 + k] + list(range(100, 349)), p, None, 2048)
               for k in range(8))
    assert s.num_preemptions > 0 and kv.usage == 0.0


def test_bench_scheduler_runs():
    from chatserve.bench.scheduler import run

    res = run(seqs=8, steps=5, prompt_len=16)
    assert res["decode_seqs_per_step"] == 8 and res["decode_step_ms"] > 0
    assert set(res["goals_met"]) == {"decode_step_ms"}


def test_a_request_waits_for_a_running_prefill_of_its_long_prefix():
    # A and B share a 200-token system prompt and arrive together. B waits one step while A computes
    # the shared blocks (C, unrelated and behind B, goes ahead), then finds them in the cache.
    s = make(num_blocks=256, block_size=16, budget=256)
    system = [(7 * i) % 50 + 1 for i in range(200)]
    s.add_request(req("A", system + [51, 52, 53]))
    s.add_request(req("B", system + [54, 55]))
    s.add_request(req("C", [60, 61, 62]))
    d = Driver(s)
    assert plan(d.step()) == [("A", 0, 203, True), ("C", 0, 3, True)]
    assert plan(d.step()) == [("A", 203, 1, True), ("C", 3, 1, True), ("B", 192, 10, True)]
    assert s.get_request("B").num_cached_tokens == 192         # every full block of the shared prompt
    d.run()
    assert d.tokens["B"] == reference(system + [54, 55], SamplingParams(max_tokens=8, ignore_eos=True),
                                      None, 1024)


def test_a_short_shared_prefix_is_not_worth_waiting_for():
    s = make(num_blocks=256, block_size=16, budget=256)
    template = list(range(1, 33))                               # two blocks of a shared chat template
    s.add_request(req("A", template + list(range(40, 100))))
    s.add_request(req("B", template + list(range(100, 150))))
    out = Driver(s).step()
    assert [p[:2] for p in plan(out)] == [("A", 0), ("B", 0)]


# ---- prompt logprobs and max_tokens 0 -----------------------------------------------------------
def _prompt_lp_step(s: Scheduler) -> tuple[SchedulerOutput, list]:
    """One step with a scripted runner: token 5 sampled; prompt position p + 1 gets logprob -(p + 1)."""
    from chatserve.core.outputs import TokenLogprob
    out = s.schedule()
    res = RunnerOutput(out.step_id)
    for q in out.seqs:
        if q.sample:
            res.sampled[q.request_id] = 5
        plen = len(q.prompt_token_ids)
        if q.params.prompt_logprobs is not None:
            res.prompt_logprobs[q.request_id] = [
                TokenLogprob(q.prompt_token_ids[p + 1], -(p + 1.0), rank=1)
                for p in range(q.start_pos, min(q.seq_len, plen - 1))]
    events = s.update(out, res)
    s.kv.check_integrity()
    return out, events


def test_prompt_logprobs_span_chunks_skip_the_prefix_cache_and_max_tokens_0_samples_nothing():
    s = make(num_blocks=32, block_size=4, budget=4)
    prompt = list(range(10, 20))
    s.add_request(req("warm", prompt, max_tokens=1))
    while s.has_unfinished:
        _prompt_lp_step(s)
    s.add_request(req("plain", prompt, max_tokens=1))        # the cache works: a hit of 8 tokens
    out, _ = _prompt_lp_step(s)
    assert plan(out) == [("plain", 8, 2, True)]
    p = SamplingParams(max_tokens=0, prompt_logprobs=2)
    s.add_request(Request("lp", list(prompt), p, eos_token_ids=frozenset({EOS})))
    starts, events = [], []
    while s.has_unfinished:
        out, evs = _prompt_lp_step(s)
        starts += [q.start_pos for q in out.seqs]
        events += evs
    assert starts == [0, 4, 8]                               # no hit: every position computed, in 3 chunks
    (ev,) = events
    assert ev.finished and ev.finish_reason is FinishReason.LENGTH and ev.new_token_ids == []
    assert [lp.token_id for lp in ev.prompt_logprobs] == prompt[1:]
    assert [lp.logprob for lp in ev.prompt_logprobs] == [-float(i) for i in range(1, 10)]
    assert not s._prompt_lps


def test_prompt_logprobs_of_an_n_group_come_once_from_the_leader():
    s = make(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(10, 17))
    reqs = [Request(f"g.{i}", list(prompt), SamplingParams(n=2, max_tokens=2, prompt_logprobs=0),
                    eos_token_ids=frozenset({EOS}), group_id="g", sample_index=i) for i in range(2)]
    s.add_group(reqs)
    got: dict[str, list] = {}
    tokens: dict[str, list] = defaultdict(list)
    while s.has_unfinished:
        _, evs = _prompt_lp_step(s)
        for ev in evs:
            tokens[ev.request_id] += ev.new_token_ids
            if ev.prompt_logprobs is not None:
                assert ev.request_id not in got
                got[ev.request_id] = ev.prompt_logprobs
    assert list(got) == ["g.0"] and [lp.token_id for lp in got["g.0"]] == prompt[1:]
    assert tokens == {"g.0": [5, 5], "g.1": [5, 5]}
