"""The engine's live client requests: each request's samples, the `RequestStream` its client reads, and
the turning of the scheduler's per-step events into `Delta`s on that stream (detokenizing, stop strings,
timings, the end of a sample).

Runs on the event loop, between steps. Not the step loop or admission (engine.py), not the channel (deltas.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from chatserve.core.errors import ErrorCode
from chatserve.core.outputs import RequestEvent, TokenLogprob
from chatserve.core.request import FinishReason, Request
from chatserve.engine.deltas import Delta, DeltaChannel, EngineStats

log = logging.getLogger("chatserve.engine")


class Detokenizer(Protocol):
    """Sampled ids → text deltas for one sample (chatserve.text.IncrementalDetokenizer)."""

    stopped: bool
    stop_str: str | None      # the stop string that ended the sample, once stopped

    def push(self, token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass
class SampleState:
    """The engine's record of one sample (one sequence) of a client request."""

    request: Request
    index: int
    detok: Detokenizer
    group: "RequestGroup"
    finished: bool = False
    num_output: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False


@dataclass
class RequestGroup:
    """One client request: its n samples and the channel they all write to."""

    request_id: str
    channel: DeltaChannel
    arrival: float
    seqs: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None   # one prompt, so one list for all n samples

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)


class RequestStream:
    """Async iterator of `Delta`s for one client request (all n samples). `close()` aborts it."""

    def __init__(self, group: RequestGroup, abort: Callable[[str], None]) -> None:
        self._group = group
        self._abort = abort
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
        self._abort(self.request_id)


class RequestStreams:
    """Every live client request by id, and the deltas the scheduler's events become.

    The engine hands in how to end a sequence in the scheduler (`finish_request`, at once) and how to
    free one that may be in the running step (`free`, deferred until the step is over)."""

    def __init__(self, stats: EngineStats, observers: list[Callable[[str, float], None]], max_buffered: int,
                 *, finish_request: Callable[[str, FinishReason], None], free: Callable[[str], None]) -> None:
        self.groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, SampleState] = {}
        self._stats = stats
        self._observers = observers
        self._max_buffered = max_buffered
        self._finish_request = finish_request
        self._free = free

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __len__(self) -> int:
        return len(self.groups)

    def open(self, request_id: str, requests: list[Request], detoks: list[Detokenizer],
             abort: Callable[[str], None]) -> RequestStream:
        """Register a client request whose samples the scheduler has just queued."""
        group = RequestGroup(request_id, DeltaChannel(self._max_buffered), time.monotonic())
        for i, (req, detok) in enumerate(zip(requests, detoks)):
            group.seqs.append(SampleState(req, i, detok, group))
            self._seqs[req.request_id] = group.seqs[-1]
        self.groups[request_id] = group
        return RequestStream(group, abort)

    def abort(self, request_id: str) -> None:
        """End every unfinished sample of a request without a final delta; its reader sees the end."""
        g = self.groups.pop(request_id, None)
        if g is None:
            return
        for s in g.seqs:
            self._seqs.pop(s.request.request_id, None)
            if not s.finished:
                s.finished = True
                self.count_finish("abort")
                self._free(s.request.request_id)
        g.channel.close()

    # ---- scheduler events → deltas ------------------------------------------------------------
    def dispatch(self, events: list[RequestEvent]) -> None:
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
                    self._finish_request(ev.request_id, FinishReason.ERROR)
                    self.finish(seq, Delta(index=seq.index), "error", now,
                                error=f"output processing failed: {type(e).__name__}")

    def _dispatch_one(self, seq: SampleState, ev: RequestEvent, now: float) -> None:
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
            self.finish(seq, d, "error", now, error=ev.error)
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
                self._finish_request(ev.request_id, FinishReason.STOP)
            self.finish(seq, d, "stop", now)
        elif ev.finished:
            d.text += seq.detok.flush()
            reason = ev.finish_reason.value if ev.finish_reason else "stop"
            self.finish(seq, d, reason, now)
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

    def _observe_tokens(self, seq: SampleState, k: int, now: float) -> None:
        seq.num_output += k
        self._stats.generation_tokens += k
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.observe("ttft", now - seq.request.arrival_time)
        elif seq.last_token_time is not None:
            self.observe("itl", (now - seq.last_token_time) / k)
        seq.last_token_time = now

    # ---- the end of a sample ------------------------------------------------------------------
    def finish(self, seq: SampleState, d: Delta, reason: str, now: float, *,
               error: str | None = None, error_code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        """The sample's last delta, with its finish reason and timings; closes the stream after the last sample."""
        seq.finished = True
        r = seq.request
        d.finish_reason = reason
        d.error = error
        d.error_code = error_code if reason == "error" else None
        d.num_output_tokens = seq.num_output
        d.e2e_s = now - r.arrival_time
        d.ttft_s = None if seq.first_token_time is None else seq.first_token_time - r.arrival_time
        d.queue_s = (r.first_scheduled_time - r.arrival_time) if r.first_scheduled_time else None
        self._observe_finish(seq, d)
        self.count_finish(reason)
        self._seqs.pop(r.request_id, None)
        g = seq.group
        self._put(g, d, force=True)
        if g.done:
            g.channel.close()
            self.groups.pop(g.request_id, None)

    def _observe_finish(self, seq: SampleState, d: Delta) -> None:
        self.observe("e2e", d.e2e_s)
        if d.queue_s is not None:
            self.observe("queue", max(0.0, d.queue_s))
            self.observe("inference", d.e2e_s - d.queue_s)
            if d.ttft_s is not None:
                self.observe("prefill", d.ttft_s - d.queue_s)
        if d.ttft_s is not None:
            self.observe("decode", d.e2e_s - d.ttft_s)
        self.observe("generation_tokens", seq.num_output)
        if seq.group.done:                                # once per request
            self.observe("prompt_tokens", seq.num_prompt_tokens or len(seq.request.prompt_token_ids))
            self.observe("params_n", len(seq.group.seqs))

    def _put(self, g: RequestGroup, d: Delta, *, force: bool = False) -> None:
        if g.channel.put(d, force=force):
            return
        # the reader is max_buffered deltas behind: end the request rather than grow or wait
        log.warning("request %s: client not reading, ending it", g.request_id)
        for s in g.seqs:
            if not s.finished:
                s.finished = True
                self.count_finish("error")
                self._seqs.pop(s.request.request_id, None)
                self._free(s.request.request_id)
                g.channel.put(Delta(index=s.index, finish_reason="error",
                                    error="stream buffer full: the client is not reading",
                                    error_code=ErrorCode.CLIENT_TOO_SLOW), force=True)
        g.channel.close()
        self.groups.pop(g.request_id, None)

    def fail_all(self, message: str) -> None:
        """End every unfinished sample with an engine error (a failed step's bookkeeping)."""
        self._end_unfinished(message, ErrorCode.ENGINE_ERROR, self._error_in_scheduler)

    def end_all(self, message: str, code: ErrorCode) -> None:
        """End every unfinished sample with `message`, freeing its blocks once no step reads them (drain)."""
        self._end_unfinished(message, code, self._free)

    def _end_unfinished(self, message: str, code: ErrorCode, release: Callable[[str], None]) -> None:
        now = time.monotonic()
        for g in list(self.groups.values()):
            for s in g.seqs:
                if not s.finished:
                    release(s.request.request_id)
                    self.finish(s, Delta(index=s.index), "error", now, error=message, error_code=code)

    def _error_in_scheduler(self, request_id: str) -> None:
        try:
            self._finish_request(request_id, FinishReason.ERROR)
        except Exception:
            log.exception("finish_request failed")

    def count_finish(self, reason: str) -> None:
        self._stats.requests_finished[reason] = self._stats.requests_finished.get(reason, 0) + 1

    def observe(self, name: str, value: float) -> None:
        for fn in self._observers:
            try:
                fn(name, value)
            except Exception:
                log.exception("metrics observer failed")
