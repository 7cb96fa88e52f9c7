"""The scheduler's parts on their own: LiveRequest's stop rules, RequestQueues with fork groups, the
admission checks and prefix-wait rule, PromptLogprobs (the scheduler tests drive them all together)."""
from __future__ import annotations

import pytest

from chatserve.core.admission import (PREFIX_WAIT_MIN_TOKENS, AdmissionError, check_fits, check_group,
                                      prefix_in_flight)
from chatserve.core.errors import ErrorCode
from chatserve.core.live_request import LiveRequest
from chatserve.core.outputs import RunnerOutput, ScheduledSeq, TokenLogprob
from chatserve.core.prompt_logprobs import PromptLogprobs
from chatserve.core.request import FinishReason, Request, RequestStatus, SamplingParams
from chatserve.core.request_queues import RequestQueues

EOS = 0


def live(rid: str, prompt: list[int], key: int = 0, max_model_len: int = 100, group: str | None = None,
         index: int = 0, **params) -> LiveRequest:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset({EOS}), group_id=group,
                sample_index=index)
    return LiveRequest(r, (0, 0.0, key), max_model_len)


# ---------------------------------------------------------------------------- LiveRequest.append
def test_append_stops_at_eos_and_stop_ids_before_the_length_limit():
    e = live("a", [5, 6], max_tokens=2, stop_token_ids=[9])
    assert e.append(7) is None and e.tokens == [5, 6, 7] and e.req.output_token_ids == [7]
    assert e.append(EOS) is FinishReason.STOP            # at the limit too: STOP wins
    assert live("b", [5], max_tokens=1).append(9) is FinishReason.LENGTH
    assert live("c", [5], max_tokens=3, stop_token_ids=[9], ignore_eos=True).append(9) is FinishReason.STOP


def test_append_honours_ignore_eos_and_the_context_length():
    e = live("a", [5, 6], max_model_len=4, max_tokens=10, ignore_eos=True)
    assert e.append(EOS) is None                          # EOS is an ordinary token here
    assert e.append(EOS) is FinishReason.LENGTH           # 4 tokens: the context is full


# ---------------------------------------------------------------------------- RequestQueues
def test_queues_keep_key_order_and_count_waiting_tokens():
    q = RequestQueues()
    late, early = live("late", [1, 2, 3], key=2), live("early", [1], key=1)
    q.add([late])
    q.add([early])
    assert q.waiting == [early, late] and q.waiting_tokens == 4 and q.num_waiting == 2
    assert q.progress("late") == {"phase": "queued", "queue_position": 2}
    assert q.pop_waiting(0) is early and q.waiting_tokens == 3
    early.req.status = RequestStatus.RUNNING
    q.insert_running(early)
    q.remove(early)
    assert q.running == [] and "early" not in q.entries and q.progress("early") is None


def test_a_leader_that_ends_before_the_fork_hands_its_group_on():
    q = RequestQueues()
    group = [live(f"s{i}", [1, 2], key=i, group="g", index=i) for i in range(3)]
    q.add(group)
    assert [e.req.status for e in group] == [RequestStatus.WAITING] + [RequestStatus.WAITING_FOR_FORK] * 2
    assert q.num_waiting == 3 and q.groups.siblings == {"s0": group[1:]}
    q.remove(group[0])
    assert q.waiting == [group[1]] and group[1].req.status is RequestStatus.WAITING
    assert q.groups.siblings == {"s1": [group[2]]} and q.num_waiting == 2
    group[1].req.status = RequestStatus.RUNNING           # s1 runs: its sibling's seat is held
    q.waiting.remove(group[1])
    q.insert_running(group[1])
    assert q.reserved_seats() == 1
    assert q.groups.release("s1") == [group[2]] and q.groups.num_pending == 0 and q.reserved_seats() == 0


# ---------------------------------------------------------------------------- admission
def test_check_group_and_check_fits():
    with pytest.raises(ValueError):
        check_group([], {})
    a = Request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError):
        check_group([a], {"a": object()})
    with pytest.raises(ValueError):                       # siblings without a group id
        check_group([a, Request("b", [1, 2], SamplingParams(), sample_index=1)], {})
    limits = dict(max_model_len=64, block_size=16, num_blocks=3, max_num_seqs=4)
    check_fits(16, 32, 4, **limits)
    for args, code in (((0, 1, 1), ErrorCode.INVALID_VALUE), ((60, 8, 1), ErrorCode.CONTEXT_LENGTH_EXCEEDED),
                       ((16, 40, 1), ErrorCode.INVALID_VALUE), ((16, 8, 5), ErrorCode.INVALID_VALUE)):
        with pytest.raises(AdmissionError) as info:
            check_fits(*args, **limits)
        assert info.value.code is code


def test_prefix_in_flight_needs_a_long_enough_shared_prefill():
    bs = 16
    prefix = list(range(1, PREFIX_WAIT_MIN_TOKENS + 1))
    running = live("r", prefix + [999] * bs)
    running.req.num_computed_tokens = bs                  # one block cached, the rest being computed
    waiting = prefix + [7] * (2 * bs)
    assert not prefix_in_flight(waiting, None, [running], bs)     # saves PREFIX_WAIT_MIN_TOKENS - bs only
    running.req.num_computed_tokens = 0
    assert prefix_in_flight(waiting, None, [running], bs)
    assert not prefix_in_flight(waiting, "other-owner", [running], bs)


# ---------------------------------------------------------------------------- PromptLogprobs
def test_prompt_logprobs_gather_replaces_a_recomputed_chunk():
    lps = PromptLogprobs()
    lps.track("a")
    prompt = [1, 2, 3, 4, 5]

    def chunk(start: int, n: int, mark: float) -> tuple[ScheduledSeq, RunnerOutput]:
        seq = ScheduledSeq("a", prompt[start:start + n], start, [0], False, SamplingParams(), prompt)
        out = [TokenLogprob(prompt[p + 1], mark) for p in range(start, min(start + n, len(prompt) - 1))]
        return seq, RunnerOutput(0, prompt_logprobs={"a": out})

    assert lps.gather(*chunk(0, 2, -1.0), computed=2) is None
    assert lps.gather(*chunk(0, 2, -2.0), computed=2) is None     # after a preemption: replaced
    got = lps.gather(*chunk(2, 3, -3.0), computed=5)
    assert [(t.token_id, t.logprob) for t in got] == [(2, -2.0), (3, -2.0), (4, -3.0), (5, -3.0)]
    assert "a" not in lps and not lps
