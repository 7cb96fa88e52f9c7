"""AsyncEngine: the one asyncio step loop between the HTTP layer and the model.

schedule → runner.execute in a worker thread → update → events to request_streams.py (detokenize, deltas
on per-request channels). Not the scheduler (core/scheduler.py), not the model (runtime/), not HTTP (server/).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Callable

from chatserve.config import EngineConfig
from chatserve.core.errors import ErrorCode
from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.protocols import KVCache, Runner, SchedulerLike, TokenizerLike
from chatserve.core.request import FinishReason, Request, SamplingParams
from chatserve.core.admission import AdmissionError  # re-exported: the server catches it from here
from chatserve.engine.deltas import Delta, DeltaChannel, EngineStats  # re-exported: the engine's outputs
from chatserve.engine.request_streams import Detokenizer, RequestStream, RequestStreams  # re-exported

log = logging.getLogger("chatserve.engine")

MAX_BUFFERED_DELTAS = 4096   # per request: a reader this far behind is ended (the engine never waits)
__all__ = ["AsyncEngine", "AdmissionError", "Delta", "DeltaChannel", "Detokenizer", "EngineStats", "RequestStream",
           "MAX_BUFFERED_DELTAS"]


class AsyncEngine:
    """Owns the runner, the KV cache manager and the scheduler, and drives them from one task."""

    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 tokenizer: TokenizerLike | None = None, *, scheduler: SchedulerLike | None = None,
                 kv: KVCache | None = None, detokenizer_factory: Callable[..., Detokenizer] | None = None,
                 max_buffered_deltas: int = MAX_BUFFERED_DELTAS, warm_up: bool = True) -> None:
        """Parts not given are built by chatserve.engine.builder at load(); warm_up: compile the kernels and
        run one dummy prefill + decode there, before the engine reports ready."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv = kv
        self._detok_factory = detokenizer_factory
        self._warm_up = warm_up
        self.warm_up_seconds: float | None = None
        self._pending_aborts: set[str] = set()
        self._in_step = False
        self._accepting = True
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        # the model is loaded and every step runs on this one thread: torch's OpenMP keeps a team of
        # workers per calling thread, and steps slow down when more than one thread has used it
        # (see load)
        self._step_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                thread_name_prefix="chatserve-step")
        self._wake: asyncio.Event | None = None
        self._stats = EngineStats()
        self.last_step_time: float | None = None
        # (name, seconds) observations for histograms: ttft, itl, e2e, queue; the list is shared with
        # self._streams, so observers are appended, never the list replaced
        self.observers: list[Callable[[str, float], None]] = []
        self._streams = RequestStreams(self._stats, self.observers, max_buffered_deltas,
                                       finish_request=self._finish_in_scheduler, free=self._free)

    # ---- construction -------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.runner is not None and self.scheduler is not None and self.tokenizer is not None

    def load(self, progress: bool = False) -> None:
        """Build whatever was not injected (chatserve.engine.builder): runner (loads weights), tokenizer,
        KV cache manager, scheduler; then warm up. Blocking; call it before the event loop starts.

        It runs on the step thread: the thread that first runs torch's OpenMP code keeps a team of
        workers, and a model loaded on another thread steps markedly slower (docs/benchmarks.md).
        """
        self._step_pool.submit(self._load, progress).result()

    def _load(self, progress: bool = False) -> None:
        from chatserve.engine.builder import build_engine_parts
        parts = build_engine_parts(self.config, runner=self.runner, tokenizer=self.tokenizer, kv=self.kv,
                                   scheduler=self.scheduler, warm_up=self._warm_up, progress=progress)
        self.runner, self.tokenizer, self.kv, self.scheduler = (parts.runner, parts.tokenizer, parts.kv,
                                                                parts.scheduler)
        self.warm_up_seconds = parts.warm_up_seconds

    @property
    def _sched(self) -> SchedulerLike:
        """The scheduler, once loaded (every caller runs after load() or start())."""
        if self.scheduler is None:
            raise RuntimeError("the engine is not loaded: call load() or start() first")
        return self.scheduler

    @property
    def _runner(self) -> Runner:
        if self.runner is None:
            raise RuntimeError("the engine is not loaded: call load() or start() first")
        return self.runner

    @property
    def max_model_len(self) -> int:
        if self.runner is None:
            return int(self.config.scheduler.max_model_len or 2048)
        from chatserve.engine.builder import effective_max_model_len
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
        if request_id in self._streams:
            raise AdmissionError(ErrorCode.INVALID_VALUE, f"duplicate request id {request_id!r}")
        n = max(1, int(params.n))
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
        detoks = [self._new_detok(r.params, prompt_ids) for r in reqs]
        if n == 1:
            self._sched.add_request(reqs[0])
        else:
            self._sched.add_group(reqs)
        stream = self._streams.open(request_id, reqs, detoks, self.abort)
        assert self._wake is not None
        self._wake.set()
        return stream

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

    def progress(self, request_id: str) -> dict[str, Any] | None:
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
        self._streams.abort(request_id)

    def _finish_in_scheduler(self, rid: str, reason: FinishReason) -> None:
        self._sched.finish_request(rid, reason)

    def _free(self, rid: str) -> None:
        if self._in_step:
            self._pending_aborts.add(rid)     # the runner may be reading this request right now
        else:
            self._sched.finish_request(rid, FinishReason.ABORT)
            if self._wake is not None:
                self._wake.set()

    def _new_detok(self, p: SamplingParams, prompt_ids: list[int]) -> Detokenizer:
        factory = self._detok_factory or _incremental_detokenizer()
        extra = {} if p.skip_special_tokens else {"skip_special_tokens": False}
        return factory(self.tokenizer, stop=list(p.stop), include_stop_str=p.include_stop_str_in_output,
                       prompt_tail=list(prompt_ids[-4:]), **extra)

    # ---- the step loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                if not self._sched.has_unfinished:
                    self._wake.clear()
                    if not self._sched.has_unfinished and not self._stopping:
                        await self._wake.wait()
                        await self._admission_window()
                    continue
                out: SchedulerOutput = self._sched.schedule()
                if out.is_empty and not out.finished_ids:
                    # nothing runnable right now: wait for a new request or an abort, briefly
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    except TimeoutError:
                        pass
                    continue
                res = await self._execute(out)
                events = self._sched.update(out, res)
                self._stats.steps += 1
                self._streams.observe("iteration_tokens", out.num_batched_tokens)
                self.last_step_time = time.monotonic()
                self._apply_pending_aborts()
                self._streams.dispatch(events)
                await asyncio.sleep(0)   # let streams and new requests run between steps
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug in bookkeeping: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._stats.step_errors += 1
                self._in_step = False
                self._streams.fail_all(f"engine error: {type(e).__name__}: {e}")
                await asyncio.sleep(0.01)

    async def _admission_window(self) -> None:
        """Woken from idle by a new request: wait --admission-window-ms before the first step, so the
        requests that clients sent at the same moment (still being read, templated and tokenized on the
        event loop) join that step rather than wait a whole prefill behind it. Only from idle: a busy
        engine admits new requests at its next step anyway."""
        window = self.config.scheduler.admission_window_ms / 1000.0
        if window > 0 and not self._stopping:
            await asyncio.sleep(window)

    async def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._in_step = True
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._step_pool, self._runner.execute, out)
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
            self._sched.finish_request(rid, FinishReason.ABORT)

    # ---- stats and shutdown -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = dataclasses.replace(self._stats, requests_finished=dict(self._stats.requests_finished))
        s.active_requests = len(self._streams)
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
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._streams.end_all("the server is shutting down", ErrorCode.SHUTTING_DOWN)
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


def _incremental_detokenizer() -> Callable[..., Detokenizer]:
    """The default detokenizer (chatserve.text, imported at first use)."""
    from chatserve.text import IncrementalDetokenizer
    return IncrementalDetokenizer

