"""AsyncEngine: the one asyncio step loop between the HTTP layer and the model.

schedule → runner.execute in a worker thread → update → incremental detokenize → per-request channels.
Not the scheduler (core/scheduler.py), not the model (runtime/), not HTTP (server/).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from chatserve.config import EngineConfig
from chatserve.core.outputs import RequestEvent, RunnerOutput, SchedulerOutput, TokenLogprob
from chatserve.core.request import FinishReason, Request, SamplingParams

log = logging.getLogger("chatserve.engine")

from chatserve.core.scheduler import AdmissionError  # re-exported: the server catches it from here

MAX_BUFFERED_DELTAS = 4096   # per request: a reader this far behind is ended (the engine never waits)


@dataclass
class Delta:
    """New output of one sample (`index`) of a request, as produced by one engine step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" on the sample's last delta
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prefix-cache hit of this sample's prompt
    error: str | None = None             # set with finish_reason "error"
    # timings, set on a sample's last delta (seconds)
    ttft_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0


class _Channel:
    """A bounded FIFO of deltas the engine never waits on; overflow is reported to the caller."""

    def __init__(self, maxlen: int) -> None:
        self._items: collections.deque[Delta] = collections.deque()
        self._event = asyncio.Event()
        self._maxlen = maxlen
        self.closed = False

    def put(self, d: Delta, *, force: bool = False) -> bool:
        if self.closed:
            return True
        if len(self._items) >= self._maxlen and not force:
            return False
        self._items.append(d)
        self._event.set()
        return True

    def close(self) -> None:
        self.closed = True
        self._event.set()

    async def get(self) -> Delta | None:
        """Next delta, or None once closed and drained."""
        while not self._items:
            if self.closed:
                return None
            self._event.clear()
            await self._event.wait()
        return self._items.popleft()


@dataclass
class _Seq:
    request: Request
    index: int
    detok: Any
    group: "_Group"
    finished: bool = False
    num_output: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class _Group:
    request_id: str
    channel: _Channel
    arrival: float
    seqs: list[_Seq] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclass
class EngineStats:
    """A snapshot for /metrics and the stats line. Counters are totals since start."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_num_blocks: int = 0
    kv_used_blocks: int = 0
    kv_free_blocks: int = 0
    kv_cached_blocks: int = 0
    prefix_queries: int = 0      # tokens looked up in the prefix cache
    prefix_hits: int = 0         # tokens found
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_errors: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)   # finish reason → count
    active_requests: int = 0     # client requests with a live stream


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

    def __init__(self, config: EngineConfig, runner: Any = None, tokenizer: Any = None, *,
                 scheduler: Any = None, kv: Any = None,
                 detokenizer_factory: Callable[..., Any] | None = None,
                 max_buffered_deltas: int = MAX_BUFFERED_DELTAS) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv = kv
        self._detok_factory = detokenizer_factory
        self._max_buffered = max_buffered_deltas
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, _Seq] = {}
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
        """Build whatever was not injected: runner (loads weights), tokenizer, KV manager, scheduler.

        Blocking; call it from a thread or before the event loop starts. It runs on the step thread:
        the thread that first runs torch's OpenMP code keeps a team of workers, and a model loaded on
        another thread then steps 1.6-2.3× slower (2 cores: a 16-token step over 1,040 cached
        tokens 42 ms instead of 26; a 512-token prefill 510 ms instead of 220).
        """
        self._step_pool.submit(self._load, progress).result()

    def _load(self, progress: bool = False) -> None:
        mc, cc = self.config.model, self.config.cache
        if self.runner is None:
            from chatserve.runtime.model_runner import ModelRunner
            self.runner = ModelRunner(
                mc.resolved_model(), dtype=mc.dtype, device=mc.device, block_size=cc.block_size,
                num_blocks=cc.num_blocks, kv_cache_memory=cc.kv_cache_memory,
                max_model_len=self.config.scheduler.max_model_len, num_threads=mc.num_threads,
                progress=progress, weight_quant=mc.weight_quant, kv_cache_dtype=cc.kv_cache_dtype)
        if self.tokenizer is None:
            from chatserve.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_model(mc.resolved_model())
        if self.kv is None and self.scheduler is None:
            from chatserve.core.kv_cache_manager import KVCacheManager
            self.kv = KVCacheManager(
                self.runner.num_blocks, cc.block_size, enable_prefix_caching=cc.enable_prefix_caching,
                hash_seed=cc.hash_seed,
                model_key=f"{mc.resolved_model()}:{getattr(self.runner, 'dtype', mc.dtype)}",
                sliding_window=getattr(getattr(self.runner, "config", None), "kv_window", None))
        if self.scheduler is None:
            from chatserve.core.scheduler import Scheduler
            self.scheduler = Scheduler(self.config.scheduler, self.kv, max_model_len=self.max_model_len)

    @property
    def max_model_len(self) -> int:
        cap = self.config.scheduler.max_model_len
        own = getattr(self.runner, "max_model_len", None)
        if own is None:
            return int(cap or 2048)
        return int(min(own, cap) if cap else own)

    @property
    def num_blocks(self) -> int:
        return int(getattr(self.runner, "num_blocks", 0) or 0)

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
            raise AdmissionError(503, "the server is shutting down", retry_after=5.0)
        sched = self.scheduler
        if sched is None:
            return
        waiting = sched.num_waiting
        if waiting and waiting >= self.config.scheduler.max_waiting_requests:
            ra = getattr(sched, "_retry_after", None)
            raise AdmissionError(503, f"server busy: {waiting} requests waiting",
                                 retry_after=ra() if callable(ra) else 1.0)

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
               cache_salt: str | None = None, keep_warm: bool = False,
               priority: int = 0, shared_prefix_tokens: int = 0) -> RequestStream:
        """Queue one client request (params.n samples). Raises AdmissionError (400/503) at once.
        shared_prefix_tokens: leading prompt tokens of an operator-shared system prompt, whose
        full blocks are cached without the owner's salt (see KVCacheManager.add_seq)."""
        if not self._accepting or self._task is None:
            raise AdmissionError(503, "the server is shutting down" if not self._accepting
                                 else "the engine is not started", retry_after=5.0)
        if request_id in self._groups:
            raise AdmissionError(400, f"duplicate request id {request_id!r}")
        n = max(1, int(params.n))
        group = _Group(request_id, _Channel(self._max_buffered), time.monotonic())
        eos = frozenset(getattr(self.tokenizer, "eos_token_ids", ()) or ())
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
            group.seqs.append(_Seq(req, i, self._new_detok(p, prompt_ids), group))
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
        kv = self.kv if self.kv is not None else getattr(self.scheduler, "kv", None)
        reset = getattr(kv, "reset_prefix_cache", None)
        if reset is None:
            return False
        return bool(reset())

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

    def _new_detok(self, p: SamplingParams, prompt_ids: list[int]) -> Any:
        factory = self._detok_factory
        if factory is None:
            from chatserve.tokenizer import IncrementalDetokenizer
            factory = IncrementalDetokenizer
        return factory(self.tokenizer, stop=list(p.stop), include_stop_str=p.include_stop_str_in_output,
                       prompt_tail=list(prompt_ids[-4:]))

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

    def _dispatch_one(self, seq: _Seq, ev: RequestEvent, now: float) -> None:
        g = seq.group
        d = Delta(index=seq.index)
        if ev.num_prompt_tokens and not seq.num_prompt_tokens:
            seq.num_prompt_tokens = ev.num_prompt_tokens
            seq.num_cached_tokens = max(0, ev.num_cached_tokens)
            self._stats.prompt_tokens += ev.num_prompt_tokens
        d.num_prompt_tokens = seq.num_prompt_tokens or len(seq.request.prompt_token_ids)
        d.num_cached_tokens = seq.num_cached_tokens
        if ev.error:
            self._finish_seq(seq, d, "error", now, error=ev.error)
            return
        if ev.new_token_ids:
            self._observe_tokens(seq, len(ev.new_token_ids), now)
            d.token_ids = list(ev.new_token_ids)
            d.logprobs = list(ev.logprobs)
            d.text = seq.detok.push(list(ev.new_token_ids))
        if seq.detok.stopped:
            if not ev.finished:
                self.scheduler.finish_request(ev.request_id, FinishReason.STOP)
            self._finish_seq(seq, d, "stop", now)
        elif ev.finished:
            d.text += seq.detok.flush()
            reason = ev.finish_reason.value if ev.finish_reason else "stop"
            self._finish_seq(seq, d, reason, now)
        elif d.text or d.token_ids:
            self._put(g, d)

    def _observe_tokens(self, seq: _Seq, k: int, now: float) -> None:
        seq.num_output += k
        self._stats.generation_tokens += k
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._observe("ttft", now - seq.request.arrival_time)
        elif seq.last_token_time is not None:
            self._observe("itl", (now - seq.last_token_time) / k)
        seq.last_token_time = now

    def _finish_seq(self, seq: _Seq, d: Delta, reason: str, now: float, *,
                    error: str | None = None) -> None:
        seq.finished = True
        r = seq.request
        d.finish_reason = reason
        d.error = error
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
                                    error="stream buffer full: the client is not reading"), force=True)
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
            s.preemptions = int(getattr(self.scheduler, "num_preemptions", 0))
        kv = self.kv if self.kv is not None else getattr(self.scheduler, "kv", None)
        if kv is not None and hasattr(kv, "stats"):
            k = kv.stats()
            s.kv_usage = float(k.usage)
            s.kv_num_blocks = int(k.num_blocks)
            s.kv_used_blocks = int(k.used_blocks)
            s.kv_free_blocks = int(k.free_blocks)
            s.kv_cached_blocks = int(getattr(k, "cached_blocks", 0))
            s.prefix_queries = int(getattr(k, "prefix_queries", 0))
            s.prefix_hits = int(getattr(k, "prefix_hits", 0))
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
                                     error="the server is shutting down")
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
