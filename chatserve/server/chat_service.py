"""Generation as OpenAI chunk dicts: engine deltas → chat.completion.chunk / text_completion objects.

Used by /v1/chat/completions, /v1/completions, the WebSocket and the sessions routes alike.
Not validation (protocol.py), not the wire (sse.py), not logprob shapes (logprobs.py), not the
non-streaming bodies folded from these chunks (collect.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncGenerator, AsyncIterator

from chatserve.core.request import SamplingParams
from chatserve.engine.deltas import Delta
from chatserve.engine import AdmissionError
from chatserve.server.collect import collect_chat, collect_completion
from chatserve.server.errors import APIError, admission_error, engine_error_body, error_response
from chatserve.server.identity import cache_salt
from chatserve.server.logprobs import (chat_logprobs, completion_logprobs, echo_logprobs, join_logprobs,
                                       vllm_prompt_logprobs)
from chatserve.server.protocol import (ChatRequest, CompletionRequest, GenerationRequest,
                                       parse_chat_body, parse_completion_body)
from chatserve.server.reasoning_output import ChoiceReasoning, reasoning_delta
from chatserve.server.sse import ChunkStreamResponse, FiniteJSONResponse, dumps, sse_response
from chatserve.server.served_model import ServedModel
from chatserve.server.state import ServerState

# sse_response, collect_* and the JSON helpers live in sse.py and collect.py; importable from here too
__all__ = ["parse_chat_body", "parse_completion_body", "stream_chat", "stream_completion",
           "sse_response", "error_response", "collect_chat", "collect_completion", "APIError",
           "ChatRequest", "CompletionRequest", "ChunkStreamResponse", "FiniteJSONResponse", "dumps"]

log = logging.getLogger("chatserve.server")


def submit(state: ServerState, req: GenerationRequest, *, owner: str, keep_warm: bool, request_id: str,
           rate_key: str | None = None):
    """Admission to the model's engine queue (rate limits were charged by prompt_guard.admit). Raises
    APIError (400/503)."""
    served = req.served_model
    kwargs = {}
    shared = _shared_prefix_tokens(served, req)
    if shared:
        kwargs["shared_prefix_tokens"] = shared
    try:
        return served.engine.submit(req.prompt_ids, req.params, request_id=request_id,
                                    cache_salt=cache_salt(state, owner), keep_warm=keep_warm, **kwargs)
    except AdmissionError as e:
        raise admission_error(e.code, e.message, e.retry_after) from None


def _shared_prefix_tokens(served: ServedModel, req: GenerationRequest) -> int:
    """Leading tokens of an operator-shared system prompt (cached across owners), else 0."""
    prompts = served.shared_prompts
    if prompts is None or not isinstance(req, ChatRequest):
        return 0
    return prompts.shared_tokens(req.messages, req.prompt_ids)


class _Usage:
    """Token counts and timings accumulated over a request's deltas."""

    def __init__(self, n_prompt: int) -> None:
        self.prompt = n_prompt
        self.cached = 0
        self.completion = 0
        self.ttft: float | None = None
        self.queue: float | None = None
        self.e2e: float | None = None
        self.samples = 0
        self.reasoning = 0               # completion tokens spent inside think blocks

    def add(self, d) -> None:
        self.completion += len(d.token_ids)
        self.cached = max(self.cached, d.num_cached_tokens or 0)
        if d.finish_reason is not None:
            self.samples += 1
            for attr, v in (("ttft", d.ttft_s), ("queue", d.queue_s)):
                if v is not None:
                    cur = getattr(self, attr)
                    setattr(self, attr, v if cur is None else min(cur, v))
            if d.e2e_s is not None:
                self.e2e = d.e2e_s if self.e2e is None else max(self.e2e, d.e2e_s)

    def to_dict(self) -> dict:
        tps = None
        if self.ttft is not None and self.e2e is not None and self.completion > self.samples:
            span = self.e2e - self.ttft
            if span > 0:
                tps = round((self.completion - self.samples) / span, 2)
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning},
                "chatserve": {"ttft_s": r(self.ttft), "tokens_per_s": tps, "queue_s": r(self.queue)}}


def _stop_reason(d: Delta, params: SamplingParams) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the sample (None for EOS/length)."""
    if d.finish_reason != "stop":
        return None
    if d.stop_reason is not None:
        return d.stop_reason
    if d.token_ids and d.token_ids[-1] in params.stop_token_ids:
        return d.token_ids[-1]
    return None


def _log_user(req: GenerationRequest, rid: str) -> None:
    if req.user:
        log.info("request %s from user %r", rid, req.user[:256])


def _carries_output(d: Delta) -> bool:
    return bool(d.text or d.logprobs or d.finish_reason is not None or d.prompt_logprobs is not None)


async def _sendable(deltas: AsyncIterator[tuple[int, Delta]], usage: _Usage) -> AsyncIterator[tuple[int, Delta]]:
    """The (stream, delta) pairs worth a chunk, every delta counted in `usage`; a failed sample's delta
    (finish_reason "error") comes through too, for the caller to end the stream with _failure_chunk."""
    async for k, d in deltas:
        usage.add(d)
        if d.finish_reason == "error" or _carries_output(d):
            yield k, d


def _failure_chunk(d: Delta) -> dict:
    return engine_error_body(d.error or "generation failed", d.error_code)


async def stream_chat(state: ServerState, req: ChatRequest, *, owner: str, keep_warm: bool = False,
                      request_id: str | None = None, rate_key: str | None = None) -> AsyncGenerator[dict, None]:
    """chat.completion.chunk dicts: a choice's first chunk carries the role with its first text (so
    time to first chunk is time to first token), then content deltas, one finish_reason per choice,
    then a usage chunk (choices == []) carrying usage["chatserve"] timings. An engine failure yields
    one {"error": {...}} dict instead of the remaining chunks. Raises APIError before the first chunk."""
    rid = request_id or req.request_id
    tokenizer = req.served_model.tokenizer
    try:
        stream = submit(state, req, owner=owner, keep_warm=keep_warm, request_id=rid, rate_key=rate_key)
    finally:
        req.release()                     # from here the engine's live request keeps the model loaded
    _log_user(req, rid)
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": req.model, "system_fingerprint": None}
    if req.service_tier is not None:
        base["service_tier"] = req.service_tier
    usage = _Usage(len(req.prompt_ids))
    started: set[int] = set()
    calls = [req.tools.streamer() for _ in range(req.params.n)] if req.tools is not None else None
    thinks = ([ChoiceReasoning(req.reasoning.parser()) for _ in range(req.params.n)]
              if req.reasoning is not None else None)
    try:
        async for _, d in _sendable(_merged([stream]), usage):
            if d.finish_reason == "error":
                yield _failure_chunk(d)
                return
            delta, reason = _chat_delta(d, calls, thinks)
            if ((calls is not None or thinks is not None) and not delta and not d.logprobs and reason is None
                    and d.prompt_logprobs is None):
                continue
            if d.index not in started:     # the role goes with the choice's first content, never alone
                started.add(d.index)
                delta = ({"role": "assistant", "content": None, **delta} if calls is not None or thinks is not None
                         else {"role": "assistant", "content": d.text})
            choice = {"index": d.index, "delta": delta, "logprobs": chat_logprobs(tokenizer, d),
                      "finish_reason": reason, "stop_reason": _stop_reason(d, req.params)}
            if d.prompt_logprobs is not None and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, d.prompt_logprobs,
                                                                   req.prompt_logprobs)
            yield {**base, "choices": [choice]}
        usage.reasoning = sum(t.tokens for t in thinks or ())
        yield {**base, "choices": [], "usage": usage.to_dict()}
    finally:
        stream.close()


def _chat_delta(d: Delta, calls: list | None, thinks: list[ChoiceReasoning] | None) -> tuple[dict, str | None]:
    """A delta's chat fields: reasoning pieces (chatserve.reasoning), then content or tool calls read from
    the answer (chatserve.toolcalls.stream); and its finish_reason (stop → tool_calls after a call)."""
    reason = d.finish_reason
    text, delta = d.text, {}
    if thinks is not None:
        r, text = thinks[d.index].push(d.text, len(d.token_ids), final=reason is not None)
        delta = reasoning_delta(r)
    if calls is not None:
        delta.update(calls[d.index].push(text, final=reason is not None))
        reason = calls[d.index].finish_reason(reason)
    elif text:
        delta["content"] = text
    return delta, reason


async def _merged(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(which stream, item) from several engine streams as items arrive."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, st) -> None:
        try:
            async for d in st:
                await queue.put((k, d))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, st)) for k, st in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, d = await queue.get()
            if d is done:
                left -= 1
                continue
            yield k, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _submit_all(state: ServerState, req: CompletionRequest, prompts: list, *, owner: str, rid: str,
                rate_key: str | None) -> list:
    streams: list = []
    try:
        for p, (ids, _) in enumerate(prompts):
            one = req if p == 0 else dataclasses.replace(req, prompt_ids=ids)
            streams.append(submit(state, one, owner=owner, keep_warm=False,
                                  request_id=rid if p == 0 else f"{rid}-{p}", rate_key=rate_key))
    except BaseException:
        for st in streams:
            st.close()
        raise
    return streams


async def stream_completion(state: ServerState, req: CompletionRequest, *, owner: str, request_id: str | None = None,
                            rate_key: str | None = None) -> AsyncGenerator[dict, None]:
    """text_completion chunk dicts (no role chunk), then a usage chunk; errors as in stream_chat.
    Prompt p's sample j is choice p * n + j; with echo, a choice's first text starts with its prompt."""
    rid = request_id or req.request_id
    try:
        async for chunk in _completion_chunks(state, req, owner=owner, rid=rid, rate_key=rate_key):
            yield chunk
    finally:
        req.release()


async def _completion_chunks(state: ServerState, req: CompletionRequest, *, owner: str, rid: str,
                             rate_key: str | None) -> AsyncGenerator[dict, None]:
    tokenizer = req.served_model.tokenizer
    prompts = req.prompts or [(req.prompt_ids, req.prompt_text)]
    n = req.params.n
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None}
    usage = _Usage(sum(len(ids) for ids, _ in prompts))
    echo = [(text if text is not None else tokenizer.decode(ids)) if req.echo else ""
            for ids, text in prompts]
    if req.params.max_tokens == 0 and req.params.prompt_logprobs is None:   # echo only: no model work
        for p in range(len(prompts)):
            for j in range(n):
                yield {**base, "choices": [{"index": p * n + j, "text": echo[p], "logprobs": None,
                                            "finish_reason": "length", "stop_reason": None}]}
        yield {**base, "choices": [], "usage": usage.to_dict()}
        return
    try:
        streams = _submit_all(state, req, prompts, owner=owner, rid=rid, rate_key=rate_key)
    finally:
        req.release()                     # from here the engine's live requests keep the model loaded
    _log_user(req, rid)
    offsets = [0] * (n * len(prompts))
    started: set[int] = set()
    try:
        async for p, d in _sendable(_merged(streams), usage):
            if d.finish_reason == "error":
                yield _failure_chunk(d)
                return
            i = p * n + d.index
            text = d.text
            if i not in started:
                started.add(i)
                text = echo[p] + text
                offsets[i] = len(echo[p])
            lp = completion_logprobs(tokenizer, d, offsets[i])
            offsets[i] += len(d.text)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                      "stop_reason": _stop_reason(d, req.params)}
            if d.prompt_logprobs is not None:           # the choice's first chunk (vLLM streams echo so)
                if req.echo and req.logprobs is not None:
                    choice["logprobs"] = join_logprobs(
                        echo_logprobs(tokenizer, prompts[p][0], d.prompt_logprobs, req.logprobs), lp)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, d.prompt_logprobs,
                                                                     req.prompt_logprobs)
            yield {**base, "choices": [choice]}
        yield {**base, "choices": [], "usage": usage.to_dict()}
    finally:
        for st in streams:
            st.close()
