"""AsyncEngine: the one asyncio step loop between the HTTP layer and the model.

schedule → runner.execute in a worker thread → update → incremental detokenize → per-request channels.
Not the scheduler (core/scheduler.py), not the model (runtime/), not HTTP (server/).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from chatserve.config import EngineConfig
from chatserve.core.errors import ErrorCode
from chatserve.core.outputs import RequestEvent, RunnerOutput, SchedulerOutput, TokenLogprob
from chatserve.core.protocols import KVCache, Runner, SchedulerLike, TokenizerLike
from chatserve.core.request import FinishReason, Request, SamplingParams
from chatserve.core.scheduler import AdmissionError  # re-exported: the server catches it from here
from chatserve.deltas import Delta, DeltaChannel, EngineStats  # re-exported: the engine's outputs

log = logging.getLogger("chatserve.engine")

MAX_BUFFERED_DELTAS = 4096   # per request: a reader this far behind is ended (the engine never waits)


class Detokenizer(Protocol):
    """Sampled ids → text deltas for one sample (chatserve.text.IncrementalDetokenizer)."""

    stopped: bool
    stop_str: str | None      # the stop string that ended the sample, once stopped

    def push(self, token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass
class _SampleState:
    """The engine's record of one sample (one sequence) of a client request."""

    request: Request
    index: int
    detok: Detokenizer
    group: "_Group"
    finished: bool = False
    num_output: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False


@dataclass
class _Group:
    request_id: str
    channel: DeltaChannel
    arrival: float
    seqs: list[_SampleState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None   # one prompt, so one list for all n samples

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)


class RequestStream:
    """Async iterator of `Delta`s for one client request (all n samples). `close()` aborts it."""

    def __init__(self, engine: "AsyncEngine", group: _Group) -> None:
        self._engine = engine
        self._group = group
        self.request_id = group.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        d = await self._group.channel.get()
        if d is None:
            raise StopAsyncIteration
        return d

    def close(self) -> None:
        """Abort whatever is still generating (a no-op once every sample finished)."""
        self._engine.abort(self.request_id)


class AsyncEngine:
    """Owns the runner, the KV cache manager and the scheduler, and drives them from one task."""

    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 tokenizer: TokenizerLike | None = None, *, scheduler: SchedulerLike | None = None,
                 kv: KVCache | None = None, detokenizer_factory: Callable[..., Detokenizer] | None = None,
                 max_buffered_deltas: int = MAX_BUFFERED_DELTAS, warm_up: bool = True) -> None:
        """Parts not given are built by chatserve.builder at load(); warm_up: compile the kernels and
        run one dummy prefill + decode there, before the engine reports ready."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv = kv
        self._detok_factory = detokenizer_factory
        self._max_buffered = max_buffered_deltas
        self._warm_up = warm_up
        self.warm_up_seconds: float | None = None
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, _SampleState] = {}
        self._pending_aborts: set[str] = set()
        self._in_step = False
        self._accepting = True
        self._stopping = False
        self._task: asyncio.Task | None = None
        # the model is loaded and every step runs on this one thread: torch's OpenMP keeps a team of
        # workers per calling thread, and steps slow down when more than one thread has used it
        # (see load)
        self._step_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                thread_name_prefix="chatserve-step")
        self._wake: asyncio.Event | None = None
        self._stats = EngineStats()
        self.last_step_time: float | None = None
        # (name, seconds) observations for histograms: ttft, itl, e2e, queue
        self.observers: list[Callable[[str, float], None]] = []

    # ---- construction -------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.runner is not None and self.scheduler is not None and self.tokenizer is not None

    def load(self, progress: bool = False) -> None:
        """Build whatever was not injected (chatserve.builder): runner (loads weights), tokenizer,
        KV cache manager, scheduler; then warm up. Blocking; call it before the event loop starts.

        It runs on the step thread: the thread that first runs torch's OpenMP code keeps a team of
        workers, and a model loaded on another thread steps markedly slower (docs/benchmarks.md).
        """
        self._step_pool.submit(self._load, progress).result()

    def _load(self, progress: bool = False) -> None:
        from chatserve.builder import build_engine_parts
        parts = build_engine_parts(self.config, runner=self.runner, tokenizer=self.tokenizer, kv=self.kv,
                                   scheduler=self.scheduler, warm_up=self._warm_up, progress=progress)
        self.runner, self.tokenizer, self.kv, self.scheduler = (parts.runner, parts.tokenizer, parts.kv,
                                                                parts.scheduler)
        self.warm_up_seconds = parts.warm_up_seconds

    @property
    def max_model_len(self) -> int:
        if self.runner is None:
            return int(self.config.scheduler.max_model_len or 2048)
        from chatserve.builder import effective_max_model_len
        return effective_max_model_len(self.config, self.runner)

    @property
    def num_blocks(self) -> int:
        return int(self.runner.num_blocks) if self.runner is not None else 0

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    async def start(self) -> None:
        if not self.loaded:
            await asyncio.get_running_loop().run_in_executor(self._step_pool, self._load)
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._loop(), name="chatserve-engine-step")

    @property
    def ready(self) -> bool:
        return (self._task is not None and not self._task.done() and self._accepting
                and not self._stopping)

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ---- requests -----------------------------------------------------------------------------
    def check_capacity(self) -> None:
        """Raise AdmissionError(503) at once when the waiting queue is already full, so a server
        under overload can refuse before tokenizing (the scheduler still has the final word)."""
        if not self._accepting:
            raise AdmissionError(ErrorCode.SHUTTING_DOWN, "the server is shutting down", retry_after=5.0)
        sched = self.scheduler
        if sched is None:
            return
        waiting = sched.num_waiting
        if waiting and waiting >= self.config.scheduler.max_waiting_requests:
            raise AdmissionError(ErrorCode.SERVER_OVERLOADED, f"server busy: {waiting} requests waiting",
                                 retry_after=sched.retry_after())

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
               cache_salt: str | None = None, keep_warm: bool = False,
               priority: int = 0, shared_prefix_tokens: int = 0) -> RequestStream:
        """Queue one client request (params.n samples). Raises AdmissionError (400/503) at once.
        shared_prefix_tokens: leading prompt tokens of an operator-shared system prompt, whose
        full blocks are cached without the owner's salt (see KVCacheManager.add_seq)."""
        if not self._accepting or self._task is None:
            raise AdmissionError(ErrorCode.SHUTTING_DOWN, "the server is shutting down" if not self._accepting
                                 else "the engine is not started", retry_after=5.0)
        if request_id in self._groups:
            raise AdmissionError(ErrorCode.INVALID_VALUE, f"duplicate request id {request_id!r}")
        n = max(1, int(params.n))
        group = _Group(request_id, DeltaChannel(self._max_buffered), time.monotonic())
        eos = frozenset(self.tokenizer.eos_token_ids) if self.tokenizer is not None else frozenset()
        reqs: list[Request] = []
        for i in range(n):
            rid = request_id if n == 1 else f"{request_id}/{i}"
            p = dataclasses.replace(params, n=n, stop=list(params.stop),
                                    stop_token_ids=list(params.stop_token_ids))
            req = Request(request_id=rid, prompt_token_ids=list(prompt_ids), params=p,
                          eos_token_ids=eos, priority=priority, cache_salt=cache_salt,
                          shared_prefix_tokens=max(0, min(int(shared_prefix_tokens), len(prompt_ids))),
                          keep_warm=keep_warm, group_id=request_id if n > 1 else None,
                          sample_index=i)
            reqs.append(req)
            group.seqs.append(_SampleState(req, i, self._new_detok(p, prompt_ids), group))
        if n == 1:
            self.scheduler.add_request(reqs[0])
        else:
            self.scheduler.add_group(reqs)
        self._groups[request_id] = group
        for s in group.seqs:
            self._seqs[s.request.request_id] = s
        assert self._wake is not None
        self._wake.set()
        return RequestStream(self, group)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       cache_salt: str | None = None, keep_warm: bool = False,
                       priority: int = 0) -> AsyncIterator[Delta]:
        """`submit` as an async generator; leaving the loop early aborts the request."""
        stream = self.submit(prompt_ids, params, request_id=request_id, cache_salt=cache_salt,
                             keep_warm=keep_warm, priority=priority)
        try:
            async for d in stream:
                yield d
        finally:
            stream.close()

    def progress(self, request_id: str) -> dict | None:
        """The scheduler's view of a queued or prefilling request (Scheduler.progress), for the
        session layer's progress events; None once it decodes. Read on the event loop."""
        return self.scheduler.progress(request_id) if self.scheduler is not None else None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix no live request holds (benchmarks start cold with it).
        True if the cache is now empty; False if running requests still hold hashed blocks.
        Runs on the event loop, like schedule/update, so it never races a step's bookkeeping."""
        return self.kv is not None and bool(self.kv.reset_prefix_cache())

    def abort(self, request_id: str) -> None:
        """Stop every unfinished sample of a request and free its blocks (after the running step)."""
        g = self._groups.pop(request_id, None)
        if g is None:
            return
        for s in g.seqs:
            self._seqs.pop(s.request.request_id, None)
            if not s.finished:
                s.finished = True
                self._count_finish("abort")
                self._free(s.request.request_id)
        g.channel.close()

    def _free(self, rid: str) -> None:
        if self._in_step:
            self._pending_aborts.add(rid)     # the runner may be reading this request right now
        else:
            self.scheduler.finish_request(rid, FinishReason.ABORT)
            if self._wake is not None:
                self._wake.set()

    def _new_detok(self, p: SamplingParams, prompt_ids: list[int]) -> Detokenizer:
        factory = self._detok_factory
        if factory is None:
            from chatserve.text import IncrementalDetokenizer
            factory = IncrementalDetokenizer
        extra = {} if p.skip_special_tokens else {"skip_special_tokens": False}
        return factory(self.tokenizer, stop=list(p.stop), include_stop_str=p.include_stop_str_in_output,
                       prompt_tail=list(prompt_ids[-4:]), **extra)

    # ---- the step loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                if not self.scheduler.has_unfinished:
                    self._wake.clear()
                    if not self.scheduler.has_unfinished and not self._stopping:
                        await self._wake.wait()
                    continue
                out: SchedulerOutput = self.scheduler.schedule()
                if out.is_empty and not out.finished_ids:
                    # nothing runnable right now: wait for a new request or an abort, briefly
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    except TimeoutError:
                        pass
                    continue
                res = await self._execute(out)
                events = self.scheduler.update(out, res)
                self._stats.steps += 1
                self._observe("iteration_tokens", out.num_batched_tokens)
                self.last_step_time = time.monotonic()
                self._apply_pending_aborts()
                self._dispatch(events)
                await asyncio.sleep(0)   # let streams and new requests run between steps
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug in bookkeeping: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._stats.step_errors += 1
                self._in_step = False
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                await asyncio.sleep(0.01)

    async def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._in_step = True
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._step_pool, self.runner.execute, out)
        except Exception as e:
            log.exception("model step failed")
            self._stats.step_errors += 1
            msg = f"model step failed: {type(e).__name__}: {e}"
            return RunnerOutput(step_id=out.step_id, errors={s.request_id: msg for s in out.seqs})
        finally:
            self._in_step = False

    def _apply_pending_aborts(self) -> None:
        pending, self._pending_aborts = self._pending_aborts, set()
        for rid in pending:
            self.scheduler.finish_request(rid, FinishReason.ABORT)

    def _dispatch(self, events: list[RequestEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            seq = self._seqs.get(ev.request_id)
            if seq is None or seq.finished:
                continue
            try:
                self._dispatch_one(seq, ev, now)
            except Exception as e:  # e.g. a detokenizer bug: end this sequence, not the engine
                log.exception("request %s: output processing failed", ev.request_id)
                if not seq.finished:
                    self.scheduler.finish_request(ev.request_id, FinishReason.ERROR)
                    self._finish_seq(seq, Delta(index=seq.index), "error", now,
                                     error=f"output processing failed: {type(e).__name__}")

    def _dispatch_one(self, seq: _SampleState, ev: RequestEvent, now: float) -> None:
        g = seq.group
        d = Delta(index=seq.index)
        if ev.num_prompt_tokens and not seq.num_prompt_tokens:
            seq.num_prompt_tokens = ev.num_prompt_tokens
            seq.num_cached_tokens = max(0, ev.num_cached_tokens)
            self._stats.prompt_tokens += ev.num_prompt_tokens
        d.num_prompt_tokens = seq.num_prompt_tokens or len(seq.request.prompt_token_ids)
        d.num_cached_tokens = seq.num_cached_tokens
        if ev.prompt_logprobs is not None and g.prompt_logprobs is None:
            g.prompt_logprobs = ev.prompt_logprobs
        if g.prompt_logprobs is not None and not seq.sent_prompt_logprobs and (
                ev.new_token_ids or ev.finished):   # the sample's first delta that goes out
            seq.sent_prompt_logprobs = True
            d.prompt_logprobs = g.prompt_logprobs
        if ev.error:
            self._finish_seq(seq, d, "error", now, error=ev.error)
            return
        if ev.new_token_ids:
            ids = list(ev.new_token_ids)
            if len(ids) > 1 and seq.request.params.stop:
                d.text, ids = self._push_until_stop(seq.detok, ids)
            else:
                d.text = seq.detok.push(ids)
            self._observe_tokens(seq, len(ids), now)
            d.token_ids = ids
            d.logprobs = list(ev.logprobs[:len(ids)])
        if seq.detok.stopped:
            d.stop_reason = seq.detok.stop_str
            if not ev.finished:
                self.scheduler.finish_request(ev.request_id, FinishReason.STOP)
            self._finish_seq(seq, d, "stop", now)
        elif ev.finished:
            d.text += seq.detok.flush()
            reason = ev.finish_reason.value if ev.finish_reason else "stop"
            self._finish_seq(seq, d, reason, now)
        elif d.text or d.token_ids:
            self._put(g, d)

    @staticmethod
    def _push_until_stop(detok: Detokenizer, ids: list[int]) -> tuple[str, list[int]]:
        """Several tokens of one step (speculative decoding) through the detokenizer one at a time, so a
        stop string ends the output at the token that completed it: (text, the tokens kept)."""
        parts = []
        for i, t in enumerate(ids):
            parts.append(detok.push([t]))
            if detok.stopped:
                return "".join(parts), ids[:i + 1]
        return "".join(parts), ids

    def _observe_tokens(self, seq: _SampleState, k: int, now: float) -> None:
        seq.num_output += k
        self._stats.generation_tokens += k
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._observe("ttft", now - seq.request.arrival_time)
        elif seq.last_token_time is not None:
            self._observe("itl", (now - seq.last_token_time) / k)
        seq.last_token_time = now

    def _finish_seq(self, seq: _SampleState, d: Delta, reason: str, now: float, *,
                    error: str | None = None, error_code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        seq.finished = True
        r = seq.request
        d.finish_reason = reason
        d.error = error
        d.error_code = error_code if reason == "error" else None
        d.num_output_tokens = seq.num_output
        d.e2e_s = now - r.arrival_time
        d.ttft_s = None if seq.first_token_time is None else seq.first_token_time - r.arrival_time
        d.queue_s = (r.first_scheduled_time - r.arrival_time) if r.first_scheduled_time else None
        self._observe("e2e", d.e2e_s)
        if d.queue_s is not None:
            self._observe("queue", max(0.0, d.queue_s))
            self._observe("inference", d.e2e_s - d.queue_s)
            if d.ttft_s is not None:
                self._observe("prefill", d.ttft_s - d.queue_s)
        if d.ttft_s is not None:
            self._observe("decode", d.e2e_s - d.ttft_s)
        self._observe("generation_tokens", seq.num_output)
        if seq.group.done:                                # once per request
            self._observe("prompt_tokens", seq.num_prompt_tokens or len(r.prompt_token_ids))
            self._observe("params_n", len(seq.group.seqs))
        self._count_finish(reason)
        self._seqs.pop(r.request_id, None)
        g = seq.group
        self._put(g, d, force=True)
        if g.done:
            g.channel.close()
            self._groups.pop(g.request_id, None)

    def _put(self, g: _Group, d: Delta, *, force: bool = False) -> None:
        if g.channel.put(d, force=force):
            return
        # the reader is MAX_BUFFERED deltas behind: end the request rather than grow or wait
        log.warning("request %s: client not reading, ending it", g.request_id)
        for s in g.seqs:
            if not s.finished:
                s.finished = True
                self._count_finish("error")
                self._seqs.pop(s.request.request_id, None)
                self._free(s.request.request_id)
                g.channel.put(Delta(index=s.index, finish_reason="error",
                                    error="stream buffer full: the client is not reading",
                                    error_code=ErrorCode.CLIENT_TOO_SLOW), force=True)
        g.channel.close()
        self._groups.pop(g.request_id, None)

    def _fail_all(self, message: str) -> None:
        now = time.monotonic()
        for g in list(self._groups.values()):
            for s in g.seqs:
                if not s.finished:
                    try:
                        self.scheduler.finish_request(s.request.request_id, FinishReason.ERROR)
                    except Exception:
                        log.exception("finish_request failed")
                    self._finish_seq(s, Delta(index=s.index), "error", now, error=message)

    def _count_finish(self, reason: str) -> None:
        self._stats.requests_finished[reason] = self._stats.requests_finished.get(reason, 0) + 1

    def _observe(self, name: str, value: float) -> None:
        for fn in self.observers:
            try:
                fn(name, value)
            except Exception:
                log.exception("metrics observer failed")

    # ---- stats and shutdown -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = dataclasses.replace(self._stats, requests_finished=dict(self._stats.requests_finished))
        s.active_requests = len(self._groups)
        if self.scheduler is not None:
            s.running = int(self.scheduler.num_running)
            s.waiting = int(self.scheduler.num_waiting)
            s.preemptions = int(self.scheduler.num_preemptions)
            s.spec_num_drafts = int(self.scheduler.spec_num_drafts)
            s.spec_num_draft_tokens = int(self.scheduler.spec_num_draft_tokens)
            s.spec_num_accepted_tokens = int(self.scheduler.spec_num_accepted_tokens)
        if self.kv is not None:
            k = self.kv.stats()
            s.kv_usage = float(k.usage)
            s.kv_num_blocks = int(k.num_blocks)
            s.kv_used_blocks = int(k.used_blocks)
            s.kv_free_blocks = int(k.free_blocks)
            s.kv_cached_blocks = int(k.cached_blocks)
            s.prefix_queries = int(k.prefix_queries)
            s.prefix_hits = int(k.prefix_hits)
        return s

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop admitting; let streams finish for up to `drain_timeout` s; end the rest with an error."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self._groups and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        now = time.monotonic()
        for g in list(self._groups.values()):
            for s in g.seqs:
                if not s.finished:
                    self._free(s.request.request_id)
                    self._finish_seq(s, Delta(index=s.index), "error", now,
                                     error="the server is shutting down", error_code=ErrorCode.SHUTTING_DOWN)
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=max(5.0, drain_timeout))
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception:
                log.exception("engine loop ended with an error")
        if self._pending_aborts and self.scheduler is not None:
            self._apply_pending_aborts()
        self._step_pool.shutdown(wait=False)
