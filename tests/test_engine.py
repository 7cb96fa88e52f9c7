"""AsyncEngine on scripted fakes: streaming deltas, n>1, stop strings, abort, errors, drain, idling."""
from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "server"))
from fakes import EOS, fake_engine  # noqa: E402

from chatserve.core.request import SamplingParams  # noqa: E402


async def collect(stream) -> list:
    return [d async for d in stream]


def text_of(deltas, index=0) -> str:
    return "".join(d.text for d in deltas if d.index == index)


async def test_stream_greedy_until_max_tokens():
    eng = fake_engine()
    await eng.start()
    deltas = await collect(eng.generate([0, 1, 2], SamplingParams(max_tokens=5), request_id="r1"))
    assert text_of(deltas) == "defgh"
    assert [t for d in deltas for t in d.token_ids] == [3, 4, 5, 6, 7]
    last = deltas[-1]
    assert last.finish_reason == "length" and last.num_output_tokens == 5
    assert sum(d.finish_reason is not None for d in deltas) == 1
    assert last.num_prompt_tokens == 3 and last.ttft_s is not None and last.e2e_s >= last.ttft_s
    assert eng.stats().generation_tokens == 5 and eng.stats().prompt_tokens == 3
    assert eng.stats().kv_used_blocks == 0
    # the model ran in a worker thread, never on the event loop's thread
    assert eng.runner.thread_ids and all(t != __import__("threading").get_ident() for t in eng.runner.thread_ids)
    await eng.shutdown(0)


async def test_eos_finishes_with_stop():
    eng = fake_engine()
    await eng.start()
    deltas = await collect(eng.generate([EOS - 3], SamplingParams(max_tokens=50), request_id="r"))
    assert deltas[-1].finish_reason == "stop"
    assert sum(len(d.token_ids) for d in deltas) == 3       # EOS-2, EOS-1, EOS
    await eng.shutdown(0)


async def test_n2_samples_and_stop_string():
    eng = fake_engine()
    await eng.start()
    deltas = await collect(eng.generate([0], SamplingParams(n=2, max_tokens=10, stop=["de"]),
                                        request_id="g"))
    for i in (0, 1):
        assert text_of(deltas, i) == "bc"
        fin = [d for d in deltas if d.index == i and d.finish_reason]
        assert len(fin) == 1 and fin[0].finish_reason == "stop"
    assert eng.stats().kv_used_blocks == 0 and eng.scheduler.num_running == 0
    await eng.shutdown(0)


async def test_abort_frees_blocks_and_other_requests_continue():
    eng = fake_engine(delay=0.002)
    await eng.start()
    long = eng.submit([0], SamplingParams(max_tokens=200, ignore_eos=True), request_id="long")
    short = eng.generate([5], SamplingParams(max_tokens=4), request_id="short")
    first = await long.__anext__()
    assert first.index == 0
    long.close()
    assert await collect(long) == [] or True
    out = await collect(short)
    assert text_of(out) == "ghij"
    await asyncio.sleep(0.05)
    st = eng.stats()
    assert st.kv_used_blocks == 0 and st.running == 0 and st.waiting == 0
    assert st.requests_finished.get("abort") == 1
    await eng.shutdown(0)


async def test_breaking_out_of_generate_aborts():
    eng = fake_engine(delay=0.002)
    await eng.start()
    agen = eng.generate([0], SamplingParams(max_tokens=500, ignore_eos=True), request_id="x")
    async for _ in agen:
        break
    await agen.aclose()
    await asyncio.sleep(0.05)
    assert eng.stats().kv_used_blocks == 0 and not eng.scheduler.has_unfinished


async def test_runner_exception_ends_batch_with_error_engine_keeps_going():
    eng = fake_engine()
    await eng.start()
    eng.runner.raise_next = True
    bad = await collect(eng.generate([0], SamplingParams(max_tokens=3), request_id="a"))
    assert bad[-1].finish_reason == "error" and "boom" in bad[-1].error
    ok = await collect(eng.generate([0], SamplingParams(max_tokens=3), request_id="b"))
    assert text_of(ok) == "bcd" and ok[-1].finish_reason == "length"
    # a per-request runner error ends only that request
    both = await asyncio.gather(collect(eng.generate([13], SamplingParams(max_tokens=3), request_id="c")),
                                collect(eng.generate([1], SamplingParams(max_tokens=3), request_id="d")))
    assert both[0][-1].finish_reason == "error" and both[0][-1].error == "bad prompt"
    assert both[1][-1].finish_reason == "length"
    assert eng.ready
    await eng.shutdown(0)


async def test_admission_errors_propagate_synchronously():
    eng = fake_engine(max_waiting=1)
    await eng.start()
    eng.submit([0], SamplingParams(max_tokens=2), request_id="one")
    with pytest.raises(Exception) as e:
        eng.submit([0], SamplingParams(max_tokens=2), request_id="two")
    assert e.value.status == 503 and e.value.retry_after
    with pytest.raises(Exception) as e2:
        eng.submit([0] * 300, SamplingParams(max_tokens=2), request_id="three")
    assert e2.value.status == 400
    await eng.shutdown(1)


async def test_event_loop_stays_responsive_during_slow_step():
    eng = fake_engine(delay=0.2)
    await eng.start()
    stream = eng.submit([0], SamplingParams(max_tokens=2), request_id="slow")
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    for _ in range(10):
        await asyncio.sleep(0.005)
    assert time.monotonic() - t0 < 0.15          # the 0.2 s step did not block the loop
    await collect(stream)
    await eng.shutdown(0)


async def test_idle_engine_does_not_step():
    eng = fake_engine()
    await eng.start()
    await collect(eng.generate([0], SamplingParams(max_tokens=2), request_id="a"))
    calls = eng.runner.calls
    await asyncio.sleep(0.2)
    assert eng.runner.calls <= calls + 1          # at most one step to hand over finished ids
    await eng.shutdown(0)


async def test_shutdown_drains_then_errors_the_rest():
    eng = fake_engine(delay=0.01)
    await eng.start()
    quick = asyncio.create_task(collect(eng.generate([0], SamplingParams(max_tokens=3), request_id="q")))
    endless = asyncio.create_task(collect(eng.generate(
        [0], SamplingParams(max_tokens=10_000, ignore_eos=True), request_id="e")))
    await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await eng.shutdown(0.3)
    assert time.monotonic() - t0 < 2.0
    q, e = await quick, await endless
    assert q[-1].finish_reason == "length"
    assert e[-1].finish_reason == "error" and "shutting down" in e[-1].error
    assert not eng.ready
    with pytest.raises(Exception) as err:
        eng.submit([0], SamplingParams(), request_id="late")
    assert err.value.status == 503
    assert eng.stats().kv_used_blocks == 0


async def test_slow_reader_is_ended_not_waited_on():
    eng = fake_engine(max_buffered_deltas=5)
    await eng.start()
    stream = eng.submit([0], SamplingParams(max_tokens=100, ignore_eos=True), request_id="lazy")
    await asyncio.sleep(0.2)                       # never read while the engine produces
    deltas = await collect(stream)
    assert len(deltas) <= 6 and deltas[-1].finish_reason == "error"
    assert "not reading" in deltas[-1].error
    assert eng.stats().kv_used_blocks == 0
    await eng.shutdown(0)


async def test_logprobs_and_observers():
    eng = fake_engine()
    seen: list[str] = []
    eng.observers.append(lambda name, v: seen.append(name))
    await eng.start()
    deltas = await collect(eng.generate([0], SamplingParams(max_tokens=3, logprobs=1), request_id="lp"))
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == [1, 2, 3] and len(lps[0].top) == 2
    assert {"ttft", "itl", "e2e", "queue"} <= set(seen)
    await eng.shutdown(0)
