"""ServerState: everything the routes share, hung on `app.state.chatserve`.

A plain dataclass built once by the CLI (or a test); no I/O here.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from chatserve.config import DEFAULT_MODEL_ALIASES, EngineConfig
from chatserve.core.protocols import TokenizerLike

if TYPE_CHECKING:
    from chatserve.engine import AsyncEngine
    from chatserve.server.metrics import Metrics
    from chatserve.server.prompt_guard import PromptGuard
    from chatserve.server.ratelimit import RateLimiter
    from chatserve.server.redis_check import RedisCheck
    from chatserve.server.sessions.store import SessionStore
    from chatserve.server.shared_prompts import SharedPrompts

# an extra WebSocket message type's handler: (state, message, owner, request_id) → frames to send
WSHandler = Callable[["ServerState", dict, str, str], AsyncIterator[dict]]


@dataclass
class ServerState:
    config: EngineConfig
    engine: AsyncEngine                   # with real or scripted parts (tests)
    tokenizer: TokenizerLike | None
    model_name: str
    sessions: SessionStore | None = None  # set by the sessions module's install()
    metrics: Metrics | None = None
    session_secret: bytes = b""           # HMAC key for cache salts; random per process when unset
    vocab_size: int | None = None
    rate_limiter: RateLimiter | None = None      # None = off
    shared_prompts: SharedPrompts | None = None  # None = off
    prompt_guard: PromptGuard | None = None      # set at startup
    redis_check: RedisCheck | None = None        # with --redis-url
    # SamplingParams field → value from the model's generation config (--generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    ws_handlers: dict[str, WSHandler] = field(default_factory=dict)
    startup_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    shutdown_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.session_secret:
            s = self.config.server.session_secret
            self.session_secret = s.encode() if s else secrets.token_bytes(32)

    @property
    def default_max_tokens(self) -> int | None:
        """max_tokens of a request that sets none: --max-tokens-default, else the model's generation
        config, else None (the rest of the context, as OpenAI does)."""
        flag = self.config.server.max_tokens_default
        return flag if flag is not None else self.sampling_defaults.get("max_tokens")

    @property
    def default_max_tokens_source(self) -> str:
        if self.config.server.max_tokens_default is not None:
            return "--max-tokens-default"
        return "the model's generation config" if "max_tokens" in self.sampling_defaults else "none"

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def kv_tokens(self) -> int:
        """Token slots in the whole KV cache (0 = unknown): no one sequence can be longer."""
        return self.engine.num_blocks * self.engine.block_size

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
