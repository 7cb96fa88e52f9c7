"""Generation as OpenAI chunk dicts: engine deltas → chat.completion.chunk / text_completion objects.

Used by /v1/chat/completions, /v1/completions, the WebSocket and the sessions routes alike.
Not validation (protocol.py) and not HTTP reading (body.py).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Callable

from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chatserve.engine import AdmissionError
from chatserve.server.errors import APIError, error_response
from chatserve.server.identity import cache_salt
from chatserve.tools.stream import ToolCallFolder
from chatserve.server.protocol import (ChatRequest, CompletionRequest, GenerationRequest,
                                       parse_chat_body, parse_completion_body)

__all__ = ["precheck", "parse_chat_body", "parse_completion_body", "stream_chat", "stream_completion",
           "sse_response", "error_response", "collect_chat", "collect_completion", "APIError",
           "ChatRequest", "CompletionRequest"]

log = logging.getLogger("chatserve.server")
SSE_PING_SECONDS = 15.0


def precheck(state) -> None:
    """Cheap overload check before parsing and tokenizing: 503 + Retry-After when the queue is full."""
    check = getattr(state.engine, "check_capacity", None)
    if check is None:
        return
    try:
        check()
    except AdmissionError as e:
        raise APIError(503, e.message, code="server_overloaded", retry_after=e.retry_after or 1.0) from None


def submit(state, req: GenerationRequest, *, owner: str, keep_warm: bool, request_id: str,
           rate_key: str | None = None):
    """Admission to the engine queue (rate limits were charged by prompt_guard.admit). Raises
    APIError (400/503)."""
    kwargs = {}
    shared = _shared_prefix_tokens(state, req)
    if shared:
        kwargs["shared_prefix_tokens"] = shared
    try:
        return state.engine.submit(req.prompt_ids, req.params, request_id=request_id,
                                   cache_salt=cache_salt(state, owner), keep_warm=keep_warm, **kwargs)
    except AdmissionError as e:
        status = e.status if e.status in (400, 429, 503) else 503
        code = "server_overloaded" if status == 503 else ("context_length_exceeded"
                                                           if "context" in e.message or "long" in e.message
                                                           else "invalid_value")
        raise APIError(status, e.message, code=code,
                       retry_after=(e.retry_after or 1.0) if status == 503 else e.retry_after) from None


def _shared_prefix_tokens(state, req: GenerationRequest) -> int:
    """Leading tokens of an operator-shared system prompt (cached across owners), else 0."""
    prompts = getattr(state, "shared_prompts", None)
    if prompts is None or not isinstance(req, ChatRequest):
        return 0
    return prompts.shared_tokens(req.messages, req.prompt_ids)


def engine_error(message: str) -> dict:
    code = "shutting_down" if "shutting down" in message else (
        "client_too_slow" if "not reading" in message else "engine_error")
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


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
                "chatserve": {"ttft_s": r(self.ttft), "tokens_per_s": tps, "queue_s": r(self.queue)}}


def _token_text(tok, tid: int) -> str:
    try:
        return tok.token_str(tid)
    except Exception:
        return tok.decode([tid])


def _chat_logprobs(state, d) -> dict | None:
    if not d.logprobs:
        return None
    tok = state.tokenizer
    content = []
    for lp in d.logprobs:
        t = _token_text(tok, lp.token_id)
        content.append({
            "token": t, "logprob": lp.logprob, "bytes": list(t.encode("utf-8", "replace")),
            "top_logprobs": [{"token": (s := _token_text(tok, i)), "logprob": v,
                              "bytes": list(s.encode("utf-8", "replace"))} for i, v in lp.top]})
    return {"content": content}


async def stream_chat(state, req: ChatRequest, *, owner: str, keep_warm: bool = False,
                      request_id: str | None = None, rate_key: str | None = None) -> AsyncIterator[dict]:
    """chat.completion.chunk dicts: one role chunk, content deltas, one finish_reason per choice,
    then a usage chunk (choices == []) carrying usage["chatserve"] timings. An engine failure yields
    one {"error": {...}} dict instead of the remaining chunks. Raises APIError before the first chunk."""
    rid = request_id or req.request_id
    stream = submit(state, req, owner=owner, keep_warm=keep_warm, request_id=rid, rate_key=rate_key)
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": req.model, "system_fingerprint": None}
    usage = _Usage(len(req.prompt_ids))
    calls = [req.tools.streamer() for _ in range(req.params.n)] if req.tools is not None else None
    try:
        yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}
                                   for i in range(req.params.n)]}
        async for d in stream:
            usage.add(d)
            if d.finish_reason == "error":
                yield engine_error(d.error or "generation failed")
                return
            if not d.text and not d.logprobs and d.finish_reason is None:
                continue
            delta = {"content": d.text} if d.text else {}
            reason = d.finish_reason
            if calls is not None:          # tool calls read from the text (chatserve.tools.stream)
                delta = calls[d.index].push(d.text, final=reason is not None)
                reason = calls[d.index].finish_reason(reason)
                if not delta and not d.logprobs and reason is None:
                    continue
            yield {**base, "choices": [{"index": d.index, "delta": delta,
                                        "logprobs": _chat_logprobs(state, d),
                                        "finish_reason": reason}]}
        yield {**base, "choices": [], "usage": usage.to_dict()}
    finally:
        stream.close()


def _completion_logprobs(state, d, offset: int) -> dict | None:
    if not d.logprobs:
        return None
    tok = state.tokenizer
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in d.logprobs:
        t = _token_text(tok, lp.token_id)
        out["tokens"].append(t)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_token_text(tok, i): v for i, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(t)
    return out


async def stream_completion(state, req: CompletionRequest, *, owner: str, request_id: str | None = None,
                            rate_key: str | None = None) -> AsyncIterator[dict]:
    """text_completion chunk dicts (no role chunk), then a usage chunk; errors as in stream_chat."""
    rid = request_id or req.request_id
    stream = submit(state, req, owner=owner, keep_warm=False, request_id=rid, rate_key=rate_key)
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None}
    usage = _Usage(len(req.prompt_ids))
    offsets = [0] * req.params.n
    try:
        async for d in stream:
            usage.add(d)
            if d.finish_reason == "error":
                yield engine_error(d.error or "generation failed")
                return
            if not d.text and not d.logprobs and d.finish_reason is None:
                continue
            lp = _completion_logprobs(state, d, offsets[d.index])
            offsets[d.index] += len(d.text)
            yield {**base, "choices": [{"index": d.index, "text": d.text, "logprobs": lp,
                                        "finish_reason": d.finish_reason}]}
        yield {**base, "choices": [], "usage": usage.to_dict()}
    finally:
        stream.close()


# ---- non-streaming: the same chunks, folded --------------------------------------------------------
def _raise_chunk_error(c: dict) -> None:
    e = c["error"]
    status = 503 if e.get("code") == "shutting_down" else 500
    raise APIError(status, e["message"], code=e.get("code"), type="server_error")


async def _fold(chunks: AsyncIterator[dict], n: int, piece: Callable[[dict], str]):
    """Fold streamed chunks into per-choice text, finish reason and logprobs, plus head and usage."""
    texts, reasons, lps = [""] * n, [None] * n, [None] * n
    head: dict[str, Any] = {}
    usage = None
    async for c in chunks:
        if "error" in c:
            _raise_chunk_error(c)
        head = head or c
        if c.get("usage"):
            usage = c["usage"]
        for ch in c["choices"]:
            i = ch["index"]
            texts[i] += piece(ch)
            if ch.get("finish_reason"):
                reasons[i] = ch["finish_reason"]
            if ch.get("logprobs"):
                lps[i] = lps[i] or {}
                for k, v in ch["logprobs"].items():     # chat: content; completions: tokens, token_logprobs, ...
                    lps[i].setdefault(k, []).extend(v or [])
    return head, texts, reasons, lps, usage


async def collect_chat(chunks: AsyncIterator[dict], n: int) -> dict:
    calls = ToolCallFolder(n)
    head, texts, reasons, lps, usage = await _fold(chunks, n, calls.content)
    return {"id": head["id"], "object": "chat.completion", "created": head["created"],
            "model": head["model"], "system_fingerprint": None,
            "choices": [{"index": i, "message": calls.message(i, texts[i]),
                         "logprobs": lps[i], "finish_reason": reasons[i]} for i in range(n)],
            "usage": usage}


async def collect_completion(chunks: AsyncIterator[dict], n: int) -> dict:
    head, texts, reasons, lps, usage = await _fold(chunks, n, lambda ch: ch["text"])
    return {"id": head.get("id"), "object": "text_completion", "created": head.get("created"),
            "model": head.get("model"), "system_fingerprint": None,
            "choices": [{"index": i, "text": texts[i], "logprobs": lps[i], "finish_reason": reasons[i]}
                        for i in range(n)],
            "usage": usage}


# ---- SSE -------------------------------------------------------------------------------------------
def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ChunkStreamResponse(Response):
    """An SSE response over chunk dicts that answers with a plain JSON error (right status) when the
    first chunk raises an APIError; afterwards errors arrive as an in-stream error event."""

    def __init__(self, chunks: AsyncIterator[dict], *, send_timeout: float | None,
                 ping: float = SSE_PING_SECONDS) -> None:
        self.chunks = chunks
        self.send_timeout = send_timeout
        self.ping = ping
        self.background = None
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = self.chunks
        try:
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = None
            except APIError as e:
                await error_response(e)(scope, receive, send)
                return

            async def events() -> AsyncIterator[dict]:
                if first is not None:
                    yield {"data": _dumps(first)}
                    if "error" in first:
                        yield {"data": "[DONE]"}
                        return
                async for c in chunks:
                    yield {"data": _dumps(c)}
                    if "error" in c:
                        break
                yield {"data": "[DONE]"}

            resp = EventSourceResponse(events(), ping=self.ping, send_timeout=self.send_timeout,
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                await resp(scope, receive, send)
            except SendTimeoutError:       # the client stopped reading: end the stream, not an error
                log.warning("stream ended: the client did not read for %s s", self.send_timeout)
        finally:
            await chunks.aclose()          # aborts the request in the engine if it is still running


def sse_response(chunks: AsyncIterator[dict], request: Request | None = None) -> Response:
    """Stream chunk dicts as `data: {json}` events, `data: [DONE]` last, with keep-alive pings.
    A reader that blocks a send for ServerConfig.stream_timeout is ended; a disconnect aborts."""
    timeout = None
    if request is not None:
        st = getattr(request.app.state, "chatserve", None)
        timeout = st.config.server.stream_timeout if st is not None else None
    return ChunkStreamResponse(chunks, send_timeout=timeout)
