"""Test doubles for session tests: a scripted chat backend, a minimal app, and a real redis-server.

The backend stands in for chat_service (parse_chat_body + stream_chat), given to
`sessions.install(app, state, backend=...)`; it is not a model and tests nothing about generation itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from chatserve.config import EngineConfig, ServerConfig
from chatserve.server import sessions, ws
from chatserve.server.errors import APIError
from chatserve.server.shared_prompts import common_prefix_len
from chatserve.server.state import single_model_state


class ScriptedChat:
    """Says `reply(messages)` word by word, `delay_s` apart; `active` counts running generations.
    With `think` set, `think(messages)` comes first, as `delta.reasoning_content` (a reasoning model's
    parsed thinking), and `think_gate` (a threading.Event or asyncio.Event) holds the answer back until set."""

    def __init__(self, reply: Callable[[list[dict]], str] | None = None, delay_s: float = 0.0) -> None:
        self.reply = reply or (lambda msgs: f"echo: {msgs[-1]['content']}")
        self.think: Callable[[list[dict]], str] | None = None
        self.think_gate: Any = None
        self.delay_s = delay_s
        self.active = 0
        self.started = 0
        self.aborted = 0
        self.requests: list[dict] = []
        self.rewarms: list[dict] = []         # rewarm(...) calls: the chat each would prefill
        self._seen: dict[str, list[list[str]]] = {}

    def parse(self, body: dict, state: Any, rate_key: str | None = None) -> dict:
        msgs = body.get("messages")
        assert isinstance(msgs, list) and msgs and msgs[-1]["role"] == "user", body
        if body.get("max_tokens", 1) < 1:
            raise APIError(400, "max_tokens must be >= 1", param="max_tokens")
        return body

    async def stream(self, state: Any, req: dict, *, owner: str, keep_warm: bool,
                     request_id: str | None, rate_key: str | None = None) -> AsyncIterator[dict]:
        self.requests.append({"req": req, "owner": owner, "keep_warm": keep_warm})
        self.active += 1
        self.started += 1
        finished = False
        try:
            words = " ".join(m["content"] for m in req["messages"]).split()
            prev = self._seen.setdefault(owner, [])
            cached = max((common_prefix_len(p, words) for p in prev), default=0)
            prev.append(words)
            text = self.reply(req["messages"])
            pieces = re.findall(r"\s*\S+|\s+", text) or [""]
            base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": req.get("model", "fake")}
            yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            limit = req.get("max_tokens", 10_000)
            finish = "length" if len(pieces) > limit else "stop"
            pieces = pieces[:limit]
            thinking = re.findall(r"\s*\S+|\s+", self.think(req["messages"])) if self.think else []
            for piece in thinking:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield {**base, "choices": [{"index": 0, "delta": {"reasoning_content": piece},
                                            "finish_reason": None}]}
            while self.think_gate is not None and not self.think_gate.is_set():
                await asyncio.sleep(0.01)
            for piece in pieces:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
            yield {**base, "choices": [], "usage": {
                "prompt_tokens": len(words), "completion_tokens": len(pieces) + len(thinking),
                "total_tokens": len(words) + len(pieces) + len(thinking),
                "completion_tokens_details": {"reasoning_tokens": len(thinking)},
                "prompt_tokens_details": {"cached_tokens": cached},
                "chatserve": {"ttft_s": 0.012, "tokens_per_s": 42.0, "queue_s": 0.001}}}
            finished = True
        finally:
            self.active -= 1
            if not finished:
                self.aborted += 1


    async def rewarm(self, state: Any, messages: list[dict], *, owner: str, request_id: str,
                     model: str | None = None) -> int:
        self.rewarms.append({"messages": messages, "owner": owner, "request_id": request_id})
        return 0


class IdleEngine:
    """Stands in for the AsyncEngine a session turn asks for progress: it knows no request."""

    def progress(self, request_id: str) -> dict | None:
        return None


def make_app(backend: ScriptedChat, redis_url: str | None = None, store: Any = None,
             api_keys: tuple[str, ...] = (), model_card: dict | None = None,
             model_names: tuple[str, ...] = ()) -> Starlette:
    """The smallest app that serves the session routes, the real /v1/ws, and a /metrics with the KV
    usage gauge (the fake's running generations); no engine but an IdleEngine for progress. With
    `model_card`, GET /v1/models lists that one card (what the UI reads the thinking switch from).
    The served model answers to "fake-model", the default model's short names and `model_names`."""
    cfg = EngineConfig(server=ServerConfig(redis_url=redis_url, api_keys=api_keys))
    names = (*model_names, *([model_card["id"]] if model_card is not None else []))
    # never started: no model is loaded, so turns ask no engine for progress
    state = single_model_state(cfg, IdleEngine(), None, "fake-model", sessions=store,  # type: ignore[arg-type]  # IdleEngine: a fake
                               aliases=names)

    async def metrics(request: Any) -> PlainTextResponse:
        usage = 0.25 * backend.active
        return PlainTextResponse(f"chatserve:kv_cache_usage_perc {usage}\n")

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card]})

    extra = [Route("/v1/models", models)] if model_card is not None else []
    app = Starlette(routes=[*sessions.routes, *ws.routes, Route("/metrics", metrics), *extra])
    app.state.chatserve = state
    sessions.install(app, state, backend=backend)
    if api_keys:
        from chatserve.server.auth import APIKeyMiddleware
        app.add_middleware(APIKeyMiddleware, keys=api_keys)
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A throwaway redis-server on a free port, without persistence (a restart loses its data)."""

    binary: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes", "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@contextlib.asynccontextmanager
async def served(app: Starlette) -> AsyncIterator[str]:
    """The app on a real socket (uvicorn in this event loop; ASGITransport buffers whole responses,
    so it cannot show a client leaving mid-stream). Yields the base URL."""
    import uvicorn
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    task = asyncio.get_running_loop().create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started, "test server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)
