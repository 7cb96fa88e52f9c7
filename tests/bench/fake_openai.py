"""A small fake OpenAI-compatible server (starlette) for the benchmark tests, with switchable misbehaviour.

Not a model: it streams words, keeps prompt-prefix and KV-block bookkeeping that imitates chatserve's
/metrics, and can break the stream rules on purpose so the validators' verdicts can be asserted.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from chatserve.server.shared_prompts import common_prefix_len

from session_fakes import free_port  # noqa: F401  (tests/sessions is on sys.path: tests/conftest.py)

BLOCK = 16


@dataclass
class FakeState:
    behavior: str = "ok"      # ok | missing_done | two_finish | no_role | error_event | bad_json | drop | http500 | plain503 | usage_half
    token_delay: float = 0.002
    max_running: int = 10_000  # beyond this: 503 + Retry-After + error body
    leak_on_cancel: bool = False
    metrics: bool = True
    has_reset: bool = True
    running: int = 0
    used_blocks: int = 0
    total_blocks: int = 1000
    queries: int = 0
    hits: int = 0
    resets: int = 0
    prompts: list[tuple[str, ...]] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    cancelled: int = 0


def _err(status: int, msg: str, typ: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": None}},
                        status_code=status, headers=headers)


def build_app(st: FakeState) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(_: Request) -> Response:
        if not st.metrics:
            return PlainTextResponse("not found", status_code=404)
        lines = [
            "# TYPE chatserve:prefix_cache_queries_total counter",
            f"chatserve:prefix_cache_queries_total {float(st.queries)}",
            f"chatserve:prefix_cache_hits_total {float(st.hits)}",
            f'chatserve:num_requests_running{{model_name="fake-model"}} {float(st.running)}',
            "chatserve:num_requests_waiting 0.0",
            f"chatserve:kv_cache_usage_perc {st.used_blocks / st.total_blocks}",
            f"chatserve:kv_cache_total_blocks {float(st.total_blocks)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def reset(_: Request) -> Response:
        if not st.has_reset:
            return _err(404, "not found", "not_found_error")
        st.resets += 1
        st.prompts.clear()
        return JSONResponse({"ok": True})

    async def completions(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        body = await request.json()
        st.bodies.append(body)
        if body.get("model") != "fake-model":
            return _err(404, f"model {body.get('model')!r} not found", "not_found_error")
        if st.behavior == "http500":
            return PlainTextResponse("Internal Server Error", status_code=500)
        if st.running >= st.max_running:
            if st.behavior == "plain503":
                return PlainTextResponse("busy", status_code=503)
            return _err(503, "server overloaded, retry later", "server_overloaded", {"Retry-After": "1"})
        if chat:
            words = tuple(w for m in body["messages"] for w in (m["role"] + " " + m["content"]).split())
        else:
            p = body["prompt"]
            words = tuple(str(x) for x in p) if isinstance(p, list) else tuple(p.split())
        hit = max((common_prefix_len(words, old) for old in st.prompts), default=0) // BLOCK * BLOCK
        st.prompts.append(words)
        st.queries += len(words)
        st.hits += hit
        n = int(body.get("n", 1))
        max_tokens = int(body.get("max_tokens", 16))
        blocks = n * ((len(words) + max_tokens) // BLOCK + 1)
        st.running += 1
        st.used_blocks += blocks
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        return StreamingResponse(_stream(st, chat, n, max_tokens, len(words), hit, blocks, include_usage),
                                 media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/reset_prefix_cache", reset, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ])


async def _stream(st: FakeState, chat: bool, n: int, max_tokens: int, prompt: int, hit: int,
                  blocks: int, include_usage: bool):
    finished = False

    def chunk(idx: int, text: str | None = None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            ch = {"index": idx, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            ch = {"index": idx, "text": text or "", "finish_reason": finish}
            obj = "text_completion"
        return "data: " + json.dumps({"id": "x", "object": obj, "created": int(time.time()),
                                      "model": "fake-model", "choices": [ch]}) + "\n\n"

    try:
        yield ": ping\n\n"
        if chat and st.behavior != "no_role":
            for i in range(n):
                yield chunk(i, role=True)
        for t in range(max_tokens):
            await asyncio.sleep(st.token_delay)
            if st.behavior == "error_event" and t == 2:
                yield 'data: {"error": {"message": "engine failure", "type": "server_error"}}\n\n'
                yield "data: [DONE]\n\n"
                finished = True
                return
            if st.behavior == "bad_json" and t == 1:
                yield "data: {oops\n\n"
            if st.behavior == "drop" and t == 2:
                raise RuntimeError("connection dropped on purpose")
            for i in range(n):
                last = t == max_tokens - 1
                yield chunk(i, f" w{t}", "length" if last else None)
                if last and st.behavior == "two_finish":
                    yield chunk(i, None, "stop")
        if include_usage:
            yield "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [],
                                         "usage": {"prompt_tokens": prompt, "completion_tokens":
                                                   n * max_tokens // (2 if st.behavior == "usage_half" else 1),
                                                   "total_tokens": prompt + n * max_tokens,
                                                   "prompt_tokens_details": {"cached_tokens": hit}}}) + "\n\n"
        if st.behavior != "missing_done":
            yield "data: [DONE]\n\n"
        finished = True
    finally:
        st.running -= 1
        if not finished:
            st.cancelled += 1
        if finished or not st.leak_on_cancel:
            st.used_blocks -= blocks


class FakeServer:
    """Runs the fake on a free loopback port in a background thread."""

    def __init__(self) -> None:
        self.state = FakeState()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port,
                             log_level="warning", lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> "FakeServer":
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def reset(self) -> None:
        self.state.__init__()  # type: ignore[misc]  # reset the fake's state in place (handlers hold it)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
