"""Generation as OpenAI chunk dicts: engine deltas → chat.completion.chunk / text_completion objects.

Used by /v1/chat/completions, /v1/completions, the WebSocket and the sessions routes alike.
Not validation (protocol.py) and not HTTP reading (body.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from typing import Any, AsyncIterator, Callable

import orjson
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from chatserve.engine import AdmissionError
from chatserve.server.errors import APIError, admission_error, engine_error_body, error_response, status_for
from chatserve.server.identity import cache_salt
from chatserve.server.protocol import (ChatRequest, CompletionRequest, GenerationRequest,
                                       parse_chat_body, parse_completion_body)
from chatserve.tools.stream import ToolCallFolder

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
        raise admission_error(e.code, e.message, e.retry_after) from None


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
        raise admission_error(e.code, e.message, e.retry_after) from None


def _shared_prefix_tokens(state, req: GenerationRequest) -> int:
    """Leading tokens of an operator-shared system prompt (cached across owners), else 0."""
    prompts = getattr(state, "shared_prompts", None)
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


LOGPROB_FLOOR = -9999.0    # what -inf (or a NaN) logprob is written as: JSON has no infinities


def finite(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_FLOOR


def _token_text(tok, tid: int) -> str:
    try:
        return tok.token_str(tid)
    except Exception:
        return tok.decode([tid])


def _token_bytes(tok, tid: int, text: str) -> list[int]:
    """The token's own bytes (part of a UTF-8 character stays that part), not its display text's."""
    get = getattr(tok, "token_bytes", None)
    if get is not None:
        try:
            return list(get(tid))
        except Exception:
            pass
    return list(text.encode("utf-8", "replace"))


def _chat_logprobs(state, d) -> dict | None:
    if not d.logprobs:
        return None
    tok = state.tokenizer

    def entry(tid: int, v: float) -> dict:
        t = _token_text(tok, tid)
        return {"token": t, "logprob": finite(v), "bytes": _token_bytes(tok, tid, t)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in d.logprobs]}


def _stop_reason(d, params) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the sample (None for EOS/length)."""
    if d.finish_reason != "stop":
        return None
    matched = getattr(d, "stop_reason", None)
    if matched is not None:
        return matched
    if d.token_ids and d.token_ids[-1] in params.stop_token_ids:
        return d.token_ids[-1]
    return None


def _log_user(req: GenerationRequest, rid: str) -> None:
    if req.user:
        log.info("request %s from user %r", rid, req.user[:256])


async def stream_chat(state, req: ChatRequest, *, owner: str, keep_warm: bool = False,
                      request_id: str | None = None, rate_key: str | None = None) -> AsyncIterator[dict]:
    """chat.completion.chunk dicts: a choice's first chunk carries the role with its first text (so
    time to first chunk is time to first token), then content deltas, one finish_reason per choice,
    then a usage chunk (choices == []) carrying usage["chatserve"] timings. An engine failure yields
    one {"error": {...}} dict instead of the remaining chunks. Raises APIError before the first chunk."""
    rid = request_id or req.request_id
    stream = submit(state, req, owner=owner, keep_warm=keep_warm, request_id=rid, rate_key=rate_key)
    _log_user(req, rid)
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": req.model, "system_fingerprint": None}
    usage = _Usage(len(req.prompt_ids))
    started: set[int] = set()
    calls = [req.tools.streamer() for _ in range(req.params.n)] if req.tools is not None else None
    try:
        async for d in stream:
            usage.add(d)
            if d.finish_reason == "error":
                yield engine_error_body(d.error or "generation failed", d.error_code)
                return
            if not d.text and not d.logprobs and d.finish_reason is None and d.prompt_logprobs is None:
                continue
            delta: dict[str, Any] = {"content": d.text} if d.text else {}
            reason = d.finish_reason
            if calls is not None:          # tool calls read from the text (chatserve.tools.stream)
                delta = calls[d.index].push(d.text, final=reason is not None)
                reason = calls[d.index].finish_reason(reason)
                if not delta and not d.logprobs and reason is None and d.prompt_logprobs is None:
                    continue
            if d.index not in started:     # the role goes with the choice's first content, never alone
                started.add(d.index)
                delta = ({"role": "assistant", "content": None, **delta} if calls is not None
                         else {"role": "assistant", "content": d.text})
            choice = {"index": d.index, "delta": delta, "logprobs": _chat_logprobs(state, d),
                      "finish_reason": reason, "stop_reason": _stop_reason(d, req.params)}
            if d.prompt_logprobs is not None and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(state, d.prompt_logprobs, req.prompt_logprobs)
            yield {**base, "choices": [choice]}
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
        out["token_logprobs"].append(finite(lp.logprob))
        out["top_logprobs"].append({_token_text(tok, i): finite(v) for i, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(t)
    return out


def vllm_prompt_logprobs(state, lps: list, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then per position {token id:
    {logprob, rank, decoded_token}} for the prompt token and the k most likely."""
    tok = state.tokenizer
    out: list[dict | None] = [None]
    for lp in lps:
        entry = {str(lp.token_id): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                    "decoded_token": _token_text(tok, lp.token_id)}}
        for rank, (i, v) in enumerate(lp.top[:k], 1):
            entry.setdefault(str(i), {"logprob": finite(v), "rank": rank, "decoded_token": _token_text(tok, i)})
        out.append(entry)
    return out


def echo_logprobs(state, ids: list[int], lps: list, k: int) -> dict:
    """The legacy completions logprobs of an echoed prompt: every prompt token, its logprob (null for
    the first) and the k most likely tokens at its position with the prompt token itself (up to k + 1)."""
    tok = state.tokenizer
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for pos, tid in enumerate(ids):
        t = _token_text(tok, tid)
        lp = lps[pos - 1] if 0 < pos <= len(lps) else None
        out["tokens"].append(t)
        out["text_offset"].append(offset)
        offset += len(t)
        out["token_logprobs"].append(None if lp is None else finite(lp.logprob))
        if lp is None:
            out["top_logprobs"].append(None)
            continue
        top = {_token_text(tok, i): finite(v) for i, v in lp.top[:k]}
        top.setdefault(t, finite(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def _join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


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


def _submit_all(state, req: CompletionRequest, prompts: list, *, owner: str, rid: str,
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


async def stream_completion(state, req: CompletionRequest, *, owner: str, request_id: str | None = None,
                            rate_key: str | None = None) -> AsyncIterator[dict]:
    """text_completion chunk dicts (no role chunk), then a usage chunk; errors as in stream_chat.
    Prompt p's sample j is choice p * n + j; with echo, a choice's first text starts with its prompt."""
    rid = request_id or req.request_id
    prompts = req.prompts or [(req.prompt_ids, req.prompt_text)]
    n = req.params.n
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None}
    usage = _Usage(sum(len(ids) for ids, _ in prompts))
    echo = [(text if text is not None else state.tokenizer.decode(ids)) if req.echo else ""
            for ids, text in prompts]
    if req.params.max_tokens == 0 and req.params.prompt_logprobs is None:   # echo only: no model work
        for p in range(len(prompts)):
            for j in range(n):
                yield {**base, "choices": [{"index": p * n + j, "text": echo[p], "logprobs": None,
                                            "finish_reason": "length", "stop_reason": None}]}
        yield {**base, "choices": [], "usage": usage.to_dict()}
        return
    streams = _submit_all(state, req, prompts, owner=owner, rid=rid, rate_key=rate_key)
    _log_user(req, rid)
    offsets = [0] * (n * len(prompts))
    started: set[int] = set()
    try:
        async for p, d in _merged(streams):
            usage.add(d)
            if d.finish_reason == "error":
                yield engine_error_body(d.error or "generation failed", d.error_code)
                return
            if not d.text and not d.logprobs and d.finish_reason is None and d.prompt_logprobs is None:
                continue
            i = p * n + d.index
            text = d.text
            if i not in started:
                started.add(i)
                text = echo[p] + text
                offsets[i] = len(echo[p])
            lp = _completion_logprobs(state, d, offsets[i])
            offsets[i] += len(d.text)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                      "stop_reason": _stop_reason(d, req.params)}
            if d.prompt_logprobs is not None:           # the choice's first chunk (vLLM streams echo so)
                if req.echo and req.logprobs is not None:
                    choice["logprobs"] = _join_logprobs(
                        echo_logprobs(state, prompts[p][0], d.prompt_logprobs, req.logprobs), lp)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(state, d.prompt_logprobs,
                                                                     req.prompt_logprobs)
            yield {**base, "choices": [choice]}
        yield {**base, "choices": [], "usage": usage.to_dict()}
    finally:
        for st in streams:
            st.close()


# ---- non-streaming: the same chunks, folded --------------------------------------------------------
def _raise_chunk_error(c: dict) -> None:
    e = c["error"]
    raise APIError(status_for(e.get("code")), e["message"], code=e.get("code"), type="server_error")


async def _fold(chunks: AsyncIterator[dict], n: int, piece: Callable[[dict], str]):
    """Fold streamed chunks into per-choice text, finish/stop reason and logprobs, plus head and usage."""
    texts, reasons, stops, lps, plps = [""] * n, [None] * n, [None] * n, [None] * n, [None] * n
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
                stops[i] = ch.get("stop_reason")
            if ch.get("prompt_logprobs") is not None:
                plps[i] = ch["prompt_logprobs"]
            if ch.get("logprobs"):
                lps[i] = lps[i] or {}
                for k, v in ch["logprobs"].items():     # chat: content; completions: tokens, token_logprobs, ...
                    lps[i].setdefault(k, []).extend(v or [])
    return head, texts, reasons, stops, lps, usage, plps


async def collect_chat(chunks: AsyncIterator[dict], req: ChatRequest) -> dict:
    n = req.params.n
    calls = ToolCallFolder(n)
    head, texts, reasons, stops, lps, usage, plps = await _fold(chunks, n, calls.content)
    out = {"id": head["id"], "object": "chat.completion", "created": head["created"],
           "model": head["model"], "system_fingerprint": None,
           "choices": [{"index": i, "message": calls.message(i, texts[i]),
                        "logprobs": lps[i], "finish_reason": reasons[i], "stop_reason": stops[i]}
                       for i in range(n)],
           "usage": usage}
    if req.prompt_logprobs is not None:     # vLLM: one top-level list (the n samples share the prompt)
        out["prompt_logprobs"] = next((x for x in plps if x is not None), None)
    return out


async def collect_completion(chunks: AsyncIterator[dict], req: CompletionRequest) -> dict:
    per_prompt = req.params.n
    total = per_prompt * max(1, len(req.prompts))
    head, texts, reasons, stops, lps, usage, plps = await _fold(chunks, total, lambda ch: ch["text"])
    order = list(range(total))
    if req.best_of:            # per prompt, the req.n samples with the highest cumulative logprob
        order = []
        for p in range(total // per_prompt):
            ids = range(p * per_prompt, (p + 1) * per_prompt)
            score = {i: sum(v for v in ((lps[i] or {}).get("token_logprobs") or []) if v is not None)
                     for i in ids}
            order += sorted(ids, key=lambda i: -score[i])[:req.n]
        if req.logprobs is None:
            lps = [None] * total
    return {"id": head.get("id"), "object": "text_completion", "created": head.get("created"),
            "model": head.get("model"), "system_fingerprint": None,
            "choices": [{"index": k, "text": texts[i], "logprobs": lps[i], "finish_reason": reasons[i],
                         "stop_reason": stops[i],
                         **({"prompt_logprobs": plps[i]} if req.prompt_logprobs is not None else {})}
                        for k, i in enumerate(order)],
            "usage": usage}


# ---- SSE -------------------------------------------------------------------------------------------
SSE_SEP = "\n"                # bare LF framing (`data: …\n\n`), as OpenAI and vLLM frame their streams
FIRST_CHUNK_GRACE_S = 0.05     # an admission error within this answers with its own status, not a 200 stream


def _finite_copy(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_copy(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Compact JSON that is always valid: a non-finite number (which JSON cannot represent) becomes null.
    orjson writes every chunk (it maps NaN/Infinity to null itself); the json module is the fallback
    for what orjson refuses (integers beyond 64 bits, non-str keys)."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:                    # orjson.JSONEncodeError
        pass
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        log.error("non-finite number in a response body; written as null")
        return json.dumps(_finite_copy(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class FiniteJSONResponse(JSONResponse):
    """A JSON response that never writes NaN/Infinity (nor fails on them with a 500)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


# The keep-alive is an empty event: a blank line every reader ignores. A `: ping` comment is valid SSE, but
# vLLM's benchmark client strips each network read before buffering it, so a comment that arrives alone
# loses its "\n\n" and swallows every event after it; whitespace alone survives that and the naive readers.
SSE_KEEPALIVE = b"\n\n"


def _ping_event() -> bytes:
    return SSE_KEEPALIVE


class ChunkStreamResponse(Response):
    """An SSE response over chunk dicts. An APIError raised at admission (within FIRST_CHUNK_GRACE_S)
    is answered as a plain JSON error with its status; otherwise the 200 headers and a keep-alive
    (an empty event) go out at once, so a long prefill never looks like a dead connection, and later errors
    arrive as an in-stream error event. Every event is framed with bare LF."""

    def __init__(self, chunks: AsyncIterator[dict], *, send_timeout: float | None,
                 ping: float | None = None) -> None:
        self.chunks = chunks
        self.send_timeout = send_timeout
        self.ping = ping
        self.background = None
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = self.chunks
        first_task = asyncio.ensure_future(chunks.__anext__())
        try:
            await asyncio.wait({first_task}, timeout=FIRST_CHUNK_GRACE_S)
            if first_task.done() and isinstance(first_task.exception(), APIError):
                await error_response(first_task.exception())(scope, receive, send)
                return

            async def events() -> AsyncIterator[Any]:
                if not first_task.done():
                    yield _ping_event()                 # flushes headers through buffering proxies
                try:
                    c = await first_task
                except StopAsyncIteration:
                    yield {"data": "[DONE]"}
                    return
                while True:
                    yield {"data": dumps(c)}
                    if "error" in c:
                        break
                    try:
                        c = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                yield {"data": "[DONE]"}

            async def guarded() -> AsyncIterator[Any]:
                try:
                    async for e in events():
                        yield e
                except APIError as e:                   # raised after the headers went out
                    yield {"data": dumps(e.to_dict())}
                    yield {"data": "[DONE]"}

            resp = EventSourceResponse(guarded(), ping=SSE_PING_SECONDS if self.ping is None else self.ping,
                                       sep=SSE_SEP, ping_message_factory=_ping_event,
                                       send_timeout=self.send_timeout,
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                await resp(scope, receive, send)
            except SendTimeoutError:       # the client stopped reading: end the stream, not an error
                log.warning("stream ended: the client did not read for %s s", self.send_timeout)
        finally:
            if not first_task.done():
                first_task.cancel()
                await asyncio.gather(first_task, return_exceptions=True)
            await chunks.aclose()          # aborts the request in the engine if it is still running


def sse_response(chunks: AsyncIterator[dict], request: Request | None = None) -> Response:
    """Stream chunk dicts as `data: {json}` events, `data: [DONE]` last, with keep-alive pings; every
    SSE stream of the server (chat, completions, session turns) goes through here.
    A reader that blocks a send for ServerConfig.stream_timeout is ended; a disconnect aborts."""
    timeout = None
    if request is not None:
        st = getattr(request.app.state, "chatserve", None)
        timeout = st.config.server.stream_timeout if st is not None else None
    return ChunkStreamResponse(chunks, send_timeout=timeout)
