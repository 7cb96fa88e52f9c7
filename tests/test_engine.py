"""AsyncEngine on scripted fakes: streaming deltas, n>1, stop strings, abort, errors, drain, idling."""
from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "server"))
from fakes import EOS, fake_engine  # noqa: E402

from chatserve.core.errors import ErrorCode  # noqa: E402
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
    rest = await asyncio.wait_for(collect(long), 60)   # the stream ends: buffered deltas, then nothing
    assert all(d.finish_reason is None for d in rest)   # an abort sends no final delta
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 200
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
    both = await asyncio.gather(collect(eng.generate([13, 12, 11], SamplingParams(max_tokens=3), request_id="c")),
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
    assert e.value.code is ErrorCode.SERVER_OVERLOADED and e.value.retry_after
    with pytest.raises(Exception) as e2:
        eng.submit([0] * 300, SamplingParams(max_tokens=2), request_id="three")
    assert e2.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    await eng.shutdown(1)


async def test_event_loop_stays_responsive_during_slow_step():
    """A step held inside the runner does not hold the loop: the loop keeps running other work (counted
    in ticks) while the step waits, and the step only ends when that work releases it. Were the step run
    on the loop's thread, nothing would release it but the 60 s safety timer."""
    eng = fake_engine()
    entered, release = threading.Event(), threading.Event()
    execute = eng.runner.execute

    def held(out):
        entered.set()
        release.wait()
        return execute(out)

    eng.runner.execute = held
    safety = threading.Timer(60, release.set)
    safety.start()
    await eng.start()
    stream = eng.submit([0], SamplingParams(max_tokens=2), request_id="slow")
    ticks = 0
    while not entered.is_set():
        await asyncio.sleep(0.001)
    for _ in range(10):                          # the loop runs while the step is still in the runner
        await asyncio.sleep(0)
        ticks += not release.is_set()
    release.set()
    safety.cancel()
    assert ticks == 10
    assert len(await collect(stream)) >= 1
    await eng.shutdown(0)


async def test_idle_engine_does_not_step():
    eng = fake_engine()
    await eng.start()
    await collect(eng.generate([0], SamplingParams(max_tokens=2), request_id="a"))
    calls = eng.runner.calls
    await asyncio.sleep(0.2)
    assert eng.runner.calls <= calls + 1          # at most one step to hand over finished ids
    await eng.shutdown(0)


@pytest.mark.parametrize("window_ms, together", [(0.0, False), (500.0, True)])
async def test_admission_window_lets_requests_sent_together_share_the_first_step(window_ms, together):
    """B arrives 20 ms after A at an idle engine: inside the window both run in the first step; without
    one, A's step has started alone. The order is set by the loop's timers, not by how fast the box is."""
    from dataclasses import replace

    from chatserve.config import EngineConfig, SchedulerConfig
    eng = fake_engine(EngineConfig(scheduler=replace(SchedulerConfig(), admission_window_ms=window_ms)))
    steps: list[set[str]] = []
    execute = eng.runner.execute
    eng.runner.execute = lambda out: (steps.append({s.request_id for s in out.seqs}), execute(out))[1]
    await eng.start()
    await asyncio.sleep(0.01)                   # the step loop is idle, waiting for work
    a = eng.submit([0], SamplingParams(max_tokens=2), request_id="a")
    await asyncio.sleep(0.02)
    b = eng.submit([5], SamplingParams(max_tokens=2), request_id="b")
    assert text_of(await collect(a)) == "bc" and text_of(await collect(b)) == "gh"
    assert steps and steps[0] == ({"a", "b"} if together else {"a"})
    await eng.shutdown(0)


async def test_shutdown_drains_then_errors_the_rest():
    eng = fake_engine(delay=0.01)
    await eng.start()
    quick = asyncio.create_task(collect(eng.generate([0], SamplingParams(max_tokens=3), request_id="q")))
    endless = asyncio.create_task(collect(eng.generate(
        [0], SamplingParams(max_tokens=10_000, ignore_eos=True), request_id="e")))
    await asyncio.sleep(0.02)
    await eng.shutdown(0.3)
    q, e = await quick, await endless
    assert q[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in e) < 10_000          # ended by the drain timeout, not its length
    assert e[-1].finish_reason == "error" and "shutting down" in e[-1].error
    assert not eng.ready
    with pytest.raises(Exception) as err:
        eng.submit([0], SamplingParams(), request_id="late")
    assert err.value.code is ErrorCode.SHUTTING_DOWN
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


# ---- the real scheduler and KV cache manager, with the scripted runner ------------------------
def real_engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                max_batched: int = 64, delay: float = 0.0):
    from fakes import FakeDetok, FakeRunner, FakeTokenizer

    from chatserve.config import EngineConfig, SchedulerConfig
    from chatserve.core.kv_cache_manager import KVCacheManager
    from chatserve.core.scheduler import Scheduler
    from chatserve.engine import AsyncEngine
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, hash_seed=1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched),
                      kv, max_model_len=256)
    return AsyncEngine(EngineConfig(), runner=FakeRunner(delay), tokenizer=FakeTokenizer(),
                       scheduler=sched, kv=kv, detokenizer_factory=FakeDetok)


def expected(prompt_last: int, k: int) -> list[int]:
    return [(prompt_last + 1 + i) % 64 for i in range(k)]


async def test_real_scheduler_n3_fork_and_prefix_hit():
    eng = real_engine()
    await eng.start()
    prompt = list(range(3, 14))                            # 11 tokens: 2 full blocks of 4
    deltas = await collect(eng.generate(prompt, SamplingParams(n=3, max_tokens=5), request_id="g"))
    for i in range(3):
        toks = [t for d in deltas if d.index == i for t in d.token_ids]
        assert toks == expected(13, 5)
        assert [d.finish_reason for d in deltas if d.index == i and d.finish_reason] == ["length"]
    again = await collect(eng.generate(prompt, SamplingParams(max_tokens=2), request_id="h"))
    assert again[-1].num_cached_tokens >= 8
    other = await collect(eng.generate(prompt, SamplingParams(max_tokens=2), request_id="i",
                                       cache_salt="someone else"))
    assert other[-1].num_cached_tokens == 0
    st = eng.stats()
    assert st.kv_used_blocks == 0 and st.prefix_hits >= 8
    eng.kv.check_integrity()
    await eng.shutdown(0)


async def test_real_scheduler_preemption_keeps_outputs_exact():
    eng = real_engine(num_blocks=14, block_size=4, max_num_seqs=8, delay=0.001)
    await eng.start()
    prompts = [[i * 10 + k for k in range(8)] for i in range(4)]      # distinct, 8 tokens each
    outs = await asyncio.gather(*[collect(eng.generate(p, SamplingParams(max_tokens=16, ignore_eos=True),
                                                       request_id=f"p{i}")) for i, p in enumerate(prompts)])
    for p, out in zip(prompts, outs):
        assert [t for d in out for t in d.token_ids] == expected(p[-1], 16)
        assert out[-1].finish_reason == "length"
    st = eng.stats()
    assert st.preemptions > 0 and st.kv_used_blocks == 0
    eng.kv.check_integrity()
    await eng.shutdown(0)


async def test_real_scheduler_abort_mid_step_and_chunked_prefill():
    eng = real_engine(max_batched=8, delay=0.01)
    await eng.start()
    long_prompt = [5] * 40                                 # 5 chunks of 8
    s = eng.submit(long_prompt, SamplingParams(max_tokens=100, ignore_eos=True), request_id="long")
    short = asyncio.create_task(collect(eng.generate([1, 2], SamplingParams(max_tokens=3),
                                                     request_id="short")))
    await asyncio.sleep(0.035)                             # abort lands while a step is running
    s.close()
    out = await short
    assert [t for d in out for t in d.token_ids] == [3, 4, 5]
    await asyncio.sleep(0.05)
    assert eng.stats().kv_used_blocks == 0 and not eng.scheduler.has_unfinished
    eng.kv.check_integrity()
    await eng.shutdown(0)


async def test_a_failing_detokenizer_ends_only_its_request():
    from fakes import FakeDetok

    class Flaky(FakeDetok):
        def push(self, ids):
            if 5 in ids:
                raise RuntimeError("bad bytes")
            return super().push(ids)
    eng = fake_engine()
    eng._detok_factory = Flaky
    await eng.start()
    bad, good = await asyncio.gather(
        collect(eng.generate([3], SamplingParams(max_tokens=5), request_id="bad")),
        collect(eng.generate([10], SamplingParams(max_tokens=3), request_id="good")))
    assert bad[-1].finish_reason == "error" and "output processing" in bad[-1].error
    assert text_of(good) == "lmn" and good[-1].finish_reason == "length"
    assert eng.stats().kv_used_blocks == 0
    await eng.shutdown(0)


async def test_check_capacity_refuses_early_when_the_queue_is_full():
    from dataclasses import replace

    from chatserve.config import EngineConfig, SchedulerConfig
    eng = fake_engine(EngineConfig(scheduler=replace(SchedulerConfig(), max_waiting_requests=2)),
                      max_running=1, delay=0.05)
    await eng.start()
    eng.check_capacity()                                   # empty: fine
    streams = [eng.submit([0], SamplingParams(max_tokens=5), request_id=str(i)) for i in range(3)]
    await asyncio.sleep(0.01)                              # one running, two waiting
    with pytest.raises(Exception) as e:
        eng.check_capacity()
    assert e.value.code is ErrorCode.SERVER_OVERLOADED and e.value.retry_after
    for s in streams:
        s.close()
    await eng.shutdown(0)


# ---- one builder for AsyncEngine and LLM, from the config -------------------------------------------
def test_builder_wires_every_cache_setting_and_warms_up(tiny_model):
    from chatserve.config import CacheConfig, EngineConfig, ModelConfig
    from chatserve.engine import AsyncEngine
    cfg = EngineConfig(model=ModelConfig(model=tiny_model, dtype="float32", device="cpu", weight_quant=None,
                                         chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                                       "{% endfor %}"),
                       cache=CacheConfig(block_size=8, num_blocks=40, watermark=0.1, hash_seed=7,
                                         enable_prefix_caching=False))
    eng = AsyncEngine(cfg)
    eng.load()
    assert eng.warm_up_seconds is not None and eng.warm_up_seconds > 0
    assert eng.kv.watermark == 0.1 and eng.kv.block_size == 8 and eng.kv.num_blocks == 40
    assert not eng.kv.enable_prefix_caching
    assert eng.kv.stats().used_blocks == 0                      # the warm-up left nothing behind
    assert eng.tokenizer.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) \
        == "[user]hi"                                            # --chat-template replaced the model's

    async def run() -> list[int]:
        await eng.start()
        out = []
        async for d in eng.generate(eng.tokenizer.encode("hello there"), SamplingParams(max_tokens=4,
                                    temperature=0.0, ignore_eos=True), request_id="r"):
            out += d.token_ids
        await eng.shutdown(1)
        return out

    generated = asyncio.run(run())
    from chatserve.engine.llm import LLM
    llm = LLM(tiny_model, block_size=8, num_blocks=40, watermark=0.1)
    assert llm.kv.watermark == 0.1
    assert llm.generate([eng.tokenizer.encode("hello there")],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0] == generated
    with pytest.raises(TypeError):
        LLM(tiny_model, no_such_setting=1)


def test_one_construction_path_for_the_runner_and_the_offline_driver(tiny_model):
    """The runner is built from a config only (ModelRunner.from_config, or its sections); a path with
    keyword settings is refused, so no caller gets defaults of the runner's own. offline_config is the
    scripts' way to a config, LLM(config=...) takes a whole one, and LLM.tokenizer honours chat_template."""
    from chatserve.config import OFFLINE_DEFAULTS, offline_config
    from chatserve.engine.llm import LLM
    from chatserve.runtime.model_runner import ModelRunner
    with pytest.raises(TypeError):
        ModelRunner(tiny_model, num_blocks=8)
    with pytest.raises(TypeError, match="no_such_setting"):
        offline_config(tiny_model, no_such_setting=1)
    cfg = offline_config(tiny_model, block_size=8, num_blocks=24, max_model_len=64,
                         chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert (cfg.model.dtype, cfg.model.weight_quant) == (OFFLINE_DEFAULTS["dtype"], None)
    runner = ModelRunner.from_config(cfg)
    assert (runner.block_size, runner.num_blocks, runner.max_model_len) == (8, 24, 64)
    llm = LLM(config=cfg)
    assert (llm.runner.block_size, llm.runner.num_blocks) == (8, 24)
    assert llm.tokenizer.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<user>hi"
    with pytest.raises(TypeError):
        LLM(tiny_model, config=cfg)


def test_generate_builds_its_llm_from_the_config(tiny_model, monkeypatch, capsys):
    """`chatserve generate` hands its whole config to LLM(config=...): the block size is the config's
    (CHATSERVE_BLOCK_SIZE here, not a literal 16) and --chat-template reaches LLM.tokenizer."""
    from chatserve import generate
    from chatserve.engine.llm import LLM
    built: list[LLM] = []
    init = LLM.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        built.append(self)
    monkeypatch.setattr(LLM, "__init__", spy)
    monkeypatch.setenv("CHATSERVE_BLOCK_SIZE", "8")
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    rc = generate.main(["--model", tiny_model, "--prompt", "hi", "--chat", "--chat-template", template,
                        "--max-tokens", "2", "--temperature", "0", "--dtype", "float32"])
    assert rc == 0 and capsys.readouterr().out.endswith("\n")
    (llm,) = built
    assert llm.runner.block_size == 8 and llm.config.model.chat_template == template
    assert llm.tokenizer.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<user>hi"


def test_shutdown_and_slow_readers_carry_error_codes():
    async def run():
        eng = fake_engine(delay=0.01, max_buffered_deltas=2)
        await eng.start()
        slow = eng.submit([0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="slow")
        await asyncio.sleep(0.5)                                  # never read: the buffer overflows
        deltas = [d async for d in slow]
        assert deltas[-1].error_code is ErrorCode.CLIENT_TOO_SLOW
        endless = eng.submit([0], SamplingParams(max_tokens=10_000, ignore_eos=True), request_id="e")
        await eng.shutdown(0)
        last = [d async for d in endless][-1]
        assert last.finish_reason == "error" and last.error_code is ErrorCode.SHUTTING_DOWN
    asyncio.run(run())
