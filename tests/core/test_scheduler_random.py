"""Randomised soak of the scheduler against the real KV cache manager: 10,000 requests with random
n, priorities, shared prefixes, aborts (also mid-step), runner errors and 503 retries. Checks that
every request ends exactly once, block integrity after every step, no leak, bounded waiting, and that
every completed output equals the scripted model's reference (so KV reuse never corrupts a context).
"""
from __future__ import annotations

import random
from collections import defaultdict

from chatserve.config import SchedulerConfig
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.request import FinishReason, Request, SamplingParams
from chatserve.core.errors import ErrorCode
from chatserve.core.scheduler import AdmissionError, Scheduler

import scripted_model

VOCAB = 48
EOS = 0
BS = 4
MAX_LEN = 64
SEED = 1234
HASH_SEED = 1


def next_token(ctx: tuple[int, ...], seed: int | None) -> int:
    return scripted_model.next_token(ctx, seed, VOCAB)


def reference(prompt: list[int], params: SamplingParams, seed: int | None) -> list[int]:
    return scripted_model.reference(prompt, params, seed, MAX_LEN, vocab=VOCAB, eos=EOS)


PREFIXES = [[], list(range(1, 9)), list(range(9, 21)), [5] * 6, list(range(30, 37))]


def _random_group(rng: random.Random, k: int) -> list[Request]:
    prompt = rng.choice(PREFIXES) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))]
    n = rng.choices([1, 2, 3, 8], weights=[70, 15, 10, 5])[0]
    seed = rng.randrange(1000) if n > 1 or rng.random() < 0.5 else None
    params = SamplingParams(
        n=n, max_tokens=rng.randint(1, 16), seed=seed, ignore_eos=rng.random() < 0.3,
        stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.2 else [])
    salt = rng.choice([None, None, "alice", "bob"])
    prio = rng.choice([0, 0, 0, 1, 2])
    return [Request(f"r{k}.{i}", list(prompt), params, eos_token_ids=frozenset({EOS}),
                    priority=prio, cache_salt=salt, group_id=f"r{k}" if n > 1 else None,
                    sample_index=i, keep_warm=rng.random() < 0.2)
            for i in range(n)]


def test_ten_thousand_random_requests():
    rng = random.Random(SEED)
    kv = KVCacheManager(64, BS, watermark=0.03, hash_seed=HASH_SEED)
    sched = Scheduler(SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=40,
                                      max_waiting_requests=48, max_waiting_tokens=600),
                      kv, max_model_len=MAX_LEN)
    model = scripted_model.PagedSimModel(BS, VOCAB)

    total = 10_000
    submitted = 0
    retry: list[list[Request]] = []       # refused with 503: offered again later
    reqs: dict[str, Request] = {}          # live
    every: dict[str, Request] = {}
    tokens: dict[str, list[int]] = defaultdict(list)
    ended: dict[str, FinishReason] = {}
    accepted_at: dict[str, int] = {}
    first_run: dict[str, int] = {}
    n_503 = n_400 = 0
    step = 0

    def record(ev) -> None:
        assert ev.request_id not in ended, f"{ev.request_id} ended twice"
        tokens[ev.request_id] += ev.new_token_ids
        if ev.finished:
            ended[ev.request_id] = ev.finish_reason

    while submitted < total or retry or sched.has_unfinished:
        step += 1
        assert step < 60_000, "no progress"
        # arrivals (bursty, so the queue bound is hit) and 503 retries
        arrivals = [retry.pop(0)] if retry and rng.random() < 0.5 else []
        for _ in range(min(rng.choice([0, 0, 1, 1, 2, 6]), total - submitted)):
            arrivals.append(_random_group(rng, submitted))
            submitted += 1
        for g in arrivals:
            if rng.random() < 0.01:        # one that can never fit
                bad = Request(g[0].request_id + "x", list(range(1, 60)), SamplingParams(max_tokens=10))
                try:
                    sched.add_request(bad)
                except AdmissionError as e:
                    assert e.code in (ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.INVALID_VALUE)
                    n_400 += 1
            try:
                sched.add_group(g)
            except AdmissionError as e:
                assert e.code is ErrorCode.SERVER_OVERLOADED and e.retry_after and e.retry_after >= 1.0
                n_503 += 1
                retry.append(g)
                continue
            for r in g:
                reqs[r.request_id] = r
                every[r.request_id] = r
                accepted_at[r.request_id] = step
        # random aborts of live requests (waiting, pending fork or running)
        if reqs and rng.random() < 0.08:
            rid = rng.choice(list(reqs))
            ev = sched.finish_request(rid)
            if rid in ended:
                assert ev is None
            else:
                record(ev)

        out = sched.schedule()
        for s in out.seqs:
            first_run.setdefault(s.request_id, step)
        errors = {}
        if out.seqs and rng.random() < 0.01:
            errors[rng.choice(out.seqs).request_id] = "boom"
        if out.seqs and rng.random() < 0.03:   # a client disconnect while the step runs
            ev = sched.finish_request(rng.choice(out.seqs).request_id)
            if ev is not None:
                record(ev)
        for ev in sched.update(out, model.step(out, errors)):
            record(ev)
        kv.check_integrity()
        for rid in [r for r in reqs if r in ended]:
            del reqs[rid]

    assert submitted == total and not retry, (submitted, len(retry))
    assert set(accepted_at) == set(ended), "every accepted request ends exactly once"
    assert kv.stats().used_blocks == 0 and sched.num_running == sched.num_waiting == 0
    assert n_503 > 0 and n_400 > 0 and sched.num_preemptions > 0
    assert kv.stats().prefix_hits > 0 and kv.stats().cow_copies > 0
    reasons = set(ended.values())
    assert {FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR} <= reasons

    # nothing waits forever: every non-aborted request ran, within a bounded number of steps
    waits = [first_run[r] - accepted_at[r] for r in first_run]
    assert max(waits) < 1000, max(waits)
    for rid, reason in ended.items():
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            assert rid in first_run

    # completed outputs are exactly the scripted model's, despite sharing, CoW and preemption
    checked = 0
    for rid, reason in ended.items():
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            r = every[rid]
            seed = None if r.params.seed is None else r.params.seed + r.sample_index
            assert tokens[rid] == reference(r.prompt_token_ids, r.params, seed), rid
            assert r.output_token_ids == tokens[rid]
            checked += 1
    assert checked > total // 2
