"""ServerState: everything the routes share, hung on `app.state.chatserve`.

A plain dataclass built once by the CLI (or a test); no I/O here.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from chatserve.config import DEFAULT_MODEL_ALIASES, EngineConfig


@dataclass
class ServerState:
    config: EngineConfig
    engine: Any                           # chatserve.engine.AsyncEngine (or a test double)
    tokenizer: Any
    model_name: str
    sessions: Any = None                  # set by the sessions module's install()
    metrics: Any = None                   # chatserve.server.metrics.Metrics
    session_secret: bytes = b""           # HMAC key for cache salts; random per process when unset
    vocab_size: int | None = None
    rate_limiter: Any = None              # chatserve.server.ratelimit.RateLimiter (None = off)
    shared_prompts: Any = None            # chatserve.server.shared_prompts.SharedPrompts (None = off)
    prompt_guard: Any = None              # chatserve.server.prompt_guard.PromptGuard (set at startup)
    redis_check: Any = None               # chatserve.server.redis_check.RedisCheck (with --redis-url)
    started_at: float = field(default_factory=time.time)
    # extra WebSocket message types: type → async fn(state, msg, owner, request_id) -> AsyncIterator[dict]
    ws_handlers: dict[str, Callable[..., Any]] = field(default_factory=dict)
    startup_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    shutdown_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.session_secret:
            s = self.config.server.session_secret
            self.session_secret = s.encode() if s else secrets.token_bytes(32)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def kv_tokens(self) -> int:
        """Token slots in the whole KV cache (0 = unknown): no one sequence can be longer."""
        try:
            return int(self.engine.num_blocks) * int(self.engine.block_size)
        except (AttributeError, TypeError, ValueError):
            return 0

    def model_names(self) -> set[str]:
        """Names a request may use for `model`: the served name, plus the file's own name, or for the
        default model its short names ("smollm2", as in the README)."""
        names = {self.model_name}
        path = self.config.model.model
        if path:
            import os
            names.update({path, os.path.basename(path.rstrip("/"))})
        else:
            names.update(DEFAULT_MODEL_ALIASES)
        return names
