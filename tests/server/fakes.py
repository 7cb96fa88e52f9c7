"""Scripted stand-ins for the scheduler, runner, tokenizer and detokenizer, for engine/server tests.

Not a model: token t+1 follows token t; text is one letter per token. Shared by tests/test_engine.py
and tests/server/ unit tests so they run in milliseconds without weights.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from chatserve.core.outputs import (RequestEvent, RunnerOutput, ScheduledSeq, SchedulerOutput,
                                    TokenLogprob)
from chatserve.core.request import FinishReason, Request, RequestStatus

VOCAB = 64
EOS = 63
POISON = [13, 12, 11]      # a prompt starting with these fails in the runner (a per-request error);
#                            three tokens, so schema fuzzing does not stumble on it


from chatserve.core.errors import ErrorCode  # noqa: E402
from chatserve.engine import AdmissionError as FakeAdmissionError  # noqa: E402  (the real class: the server catches it)


@dataclass
class FakeKVStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    evictions: int = 0
    cow_copies: int = 0


class FakeKV:
    """Counts blocks per request (ceil(tokens / 4)); prefix 'cache' = whole prompts seen per salt."""

    def __init__(self, num_blocks: int = 256, block_size: int = 4) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held: dict[str, int] = {}
        self.seen: set[tuple] = set()
        self.queries = self.hits = 0

    def blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def stats(self) -> FakeKVStats:
        used = sum(self.held.values())
        return FakeKVStats(self.num_blocks, self.num_blocks - used, used, 0,
                           used / self.num_blocks, self.queries, self.hits)

    def reset_prefix_cache(self) -> bool:
        self.seen.clear()
        return True


class FakeScheduler:
    """One prefill step per request, then one token per step; FCFS; max_running at once."""

    def __init__(self, kv: FakeKV, *, max_waiting: int = 64, max_running: int = 8,
                 max_model_len: int = 256) -> None:
        self.kv = kv
        self.max_waiting, self.max_running, self.max_model_len = max_waiting, max_running, max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.reqs: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self._step = 0
        self._freed: list[str] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def retry_after(self) -> float:
        return 1.0

    def progress(self, request_id: str) -> dict | None:
        return None

    def add_request(self, req: Request) -> None:
        self.add_group([req])

    def add_group(self, reqs: list[Request]) -> None:
        if reqs[0].num_prompt_tokens + 1 > self.max_model_len:
            raise FakeAdmissionError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt too long")
        if len(self.waiting) + len(reqs) > self.max_waiting:
            raise FakeAdmissionError(ErrorCode.SERVER_OVERLOADED, "queue full", retry_after=1.0)
        for r in reqs:
            self.waiting.append(r)
            self.reqs[r.request_id] = r

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.pop(0)
            r.status = RequestStatus.RUNNING
            r.first_scheduled_time = time.monotonic()
            key = (r.cache_salt, tuple(r.prompt_token_ids))
            self.kv.queries += r.num_prompt_tokens
            r.num_cached_tokens = r.num_prompt_tokens - 1 if key in self.kv.seen else 0
            self.kv.hits += max(0, r.num_cached_tokens)
            self.kv.seen.add(key)
            self.running.append(r)
        seqs = []
        for r in self.running:
            toks = r.prompt_token_ids if r.num_computed_tokens == 0 else r.output_token_ids[-1:]
            self.kv.held[r.request_id] = self.kv.blocks_for(r.num_tokens)
            seqs.append(ScheduledSeq(r.request_id, list(toks), r.num_computed_tokens, [], True,
                                     r.params, r.prompt_token_ids, r.output_token_ids))
        freed, self._freed = self._freed, []
        return SchedulerOutput(self._step, seqs, finished_ids=freed,
                               num_batched_tokens=sum(len(s.token_ids) for s in seqs))

    def update(self, out: SchedulerOutput, res: RunnerOutput) -> list[RequestEvent]:
        events = []
        for s in out.seqs:
            r = self.reqs.get(s.request_id)
            if r is None or r.is_finished:
                continue
            r.num_computed_tokens += len(s.token_ids)
            ev = RequestEvent(r.request_id, num_prompt_tokens=r.num_prompt_tokens,
                              num_cached_tokens=r.num_cached_tokens)
            if s.request_id in res.errors:
                ev.finished, ev.finish_reason, ev.error = True, FinishReason.ERROR, res.errors[s.request_id]
                self._finish(r, FinishReason.ERROR)
                events.append(ev)
                continue
            if s.start_pos == 0 and r.params.prompt_logprobs is not None:   # token t's logprob: -t / 10
                ev.prompt_logprobs = [TokenLogprob(t, -t / 10, [(0, -0.1)][:r.params.prompt_logprobs], rank=2)
                                      for t in r.prompt_token_ids[1:]]
            if r.params.max_tokens == 0:
                ev.finished, ev.finish_reason = True, FinishReason.LENGTH
                self._finish(r, FinishReason.LENGTH)
                events.append(ev)
                continue
            tok = res.sampled[s.request_id]
            r.output_token_ids.append(tok)
            ev.new_token_ids = [tok]
            if s.request_id in res.logprobs:
                ev.logprobs = [res.logprobs[s.request_id]]
            if tok in r.eos_token_ids and not r.params.ignore_eos:
                reason = FinishReason.STOP
            elif len(r.output_token_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            if reason is not None:
                ev.finished, ev.finish_reason = True, reason
                self._finish(r, reason)
            events.append(ev)
        return events

    def _finish(self, r: Request, reason: FinishReason) -> None:
        r.status, r.finish_reason = RequestStatus.FINISHED, reason
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.kv.held.pop(r.request_id, None)
        self.reqs.pop(r.request_id, None)
        self._freed.append(r.request_id)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT):
        r = self.reqs.get(request_id)
        if r is None:
            return None
        self._finish(r, reason)
        return RequestEvent(request_id, finished=True, finish_reason=reason)


class FakeRunner:
    """next token = last token + 1 (mod VOCAB); a prompt starting with 13 fails; `delay` per step."""

    num_blocks = 256
    max_model_len = 256
    vocab_size = VOCAB
    eos_token_ids = (EOS,)

    def __init__(self, delay: float = 0.0, kv_cache_dtype: str = "auto") -> None:
        self.delay = delay
        self.kv_cache_dtype = kv_cache_dtype      # the engine config's (fake_engine passes it)
        self.calls = 0
        self.raise_next = False
        self.thread_ids: set[int] = set()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.calls += 1
        self.thread_ids.add(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)
        if self.raise_next:
            self.raise_next = False
            raise RuntimeError("boom")
        res = RunnerOutput(out.step_id)
        for s in out.seqs:
            if not s.sample:                 # a prefill chunk that does not reach the end yet
                continue
            if s.prompt_token_ids[:3] == POISON:
                res.errors[s.request_id] = "bad prompt"
                continue
            tok = (s.token_ids[-1] + 1) % VOCAB
            res.sampled[s.request_id] = tok
            if s.params.logprobs is not None:
                res.logprobs[s.request_id] = TokenLogprob(tok, -0.5, [(tok, -0.5), (0, -2.0)][: s.params.logprobs + 1])
        return res


class FakeTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = VOCAB
    bos_token_id = None              # none declared (the 1 that encode and the chat template put first is a marker)
    special_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ([1] if add_special_tokens else []) + [(ord(c) - 97) % VOCAB for c in text]   # 1: the fake BOS

    def decode(self, ids: list[int]) -> str:
        return "".join(self.token_str(i) for i in ids)

    def token_str(self, i: int) -> str:
        return chr(97 + i) if i < 26 else chr(65 + (i - 26) % 26)

    def token_bytes(self, i: int) -> bytes:
        return self.token_str(i).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for m in messages:
            if not isinstance(m.get("content"), str):
                raise ValueError("content must be a string")
            ids += [1] + self.encode(m["content"])
        return ids + ([2] if add_generation_prompt else [])


class FakeDetok:
    """Holds back a tail that could start a stop string; `stopped` once one appears."""

    def __init__(self, tok: FakeTokenizer, stop: list[str] | None = None, include_stop_str: bool = False,
                 prompt_tail: list[int] | None = None, skip_special_tokens: bool = True):
        self.tok, self.stop, self.include = tok, list(stop or []), include_stop_str
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.stop_str: str | None = None

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.text += "".join(self.tok.token_str(i) for i in ids if i != EOS)
        for s in self.stop:
            k = self.text.find(s)
            if k >= 0:
                self.stopped = True
                self.stop_str = s
                end = k + len(s) if self.include else k
                out, self.emitted = self.text[self.emitted:end], end
                return out
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return "" if self.stopped else out


def fake_engine(config=None, *, delay: float = 0.0, max_waiting: int = 64, max_running: int = 8,
                max_buffered_deltas: int = 4096):
    from chatserve.config import EngineConfig
    from chatserve.engine import AsyncEngine
    kv = FakeKV()
    sched = FakeScheduler(kv, max_waiting=max_waiting, max_running=max_running)
    config = config or EngineConfig()
    return AsyncEngine(config, runner=FakeRunner(delay, config.cache.kv_cache_dtype), tokenizer=FakeTokenizer(),
                       scheduler=sched, kv=kv, detokenizer_factory=FakeDetok,
                       max_buffered_deltas=max_buffered_deltas)
