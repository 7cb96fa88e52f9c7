"""ServerState: everything the routes share, hung on `app.state.chatserve`.

Built once by the CLI (or a test: `single_model_state`); no I/O here. What belongs to one model (engine,
tokenizer, sampling defaults) is on its ServedModel (served_model.py), reached through `models`.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable

from chatserve.config import EngineConfig
from chatserve.core.protocols import TokenizerLike

if TYPE_CHECKING:
    from chatserve.engine import AsyncEngine
    from chatserve.server.metrics import Metrics
    from chatserve.server.model_registry import ModelRegistry
    from chatserve.server.ratelimit import RateLimiter
    from chatserve.server.redis_check import RedisCheck
    from chatserve.server.responses.store import ResponseStore
    from chatserve.server.sessions.store import SessionStore

# an extra WebSocket message type's handler: (state, message, owner, request_id) → frames to send
WSHandler = Callable[["ServerState", dict, str, str], AsyncGenerator[dict, None]]


@dataclass
class ServerState:
    config: EngineConfig                  # the server's settings (each model's own: models.spec(name).config)
    models: ModelRegistry                 # the served models, loaded on demand
    sessions: SessionStore | None = None  # set by the sessions module's install()
    responses: ResponseStore | None = None  # stored /v1/responses; set by the responses module's install()
    metrics: Metrics | None = None
    session_secret: bytes = b""           # HMAC key for cache salts; random per process when unset
    rate_limiter: RateLimiter | None = None      # None = off
    redis_check: RedisCheck | None = None        # with --redis-url
    started_at: float = field(default_factory=time.time)
    ws_handlers: dict[str, WSHandler] = field(default_factory=dict)
    startup_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    shutdown_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    _frozen: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.session_secret:
            s = self.config.server.session_secret
            self.session_secret = s.encode() if s else secrets.token_bytes(32)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"ServerState is complete once the app is built: {name} cannot change")
        super().__setattr__(name, value)

    def freeze(self) -> None:
        """Called by build_app once every part is in place (stores, metrics, limiter): from then on no
        field is reassigned (the per-model parts live on each ServedModel, themselves frozen)."""
        object.__setattr__(self, "_frozen", True)

    @property
    def model_name(self) -> str:
        """The default model's served name (a request without `model` gets it)."""
        return self.models.default_name


def single_model_state(config: EngineConfig, engine: AsyncEngine, tokenizer: TokenizerLike | None = None,
                       model_name: str = "model", *, vocab_size: int | None = None,
                       sampling_defaults: dict[str, Any] | None = None, aliases: tuple[str, ...] = (),
                       **fields: Any) -> ServerState:
    """A ServerState serving one model whose engine the caller built (tests, embedders); the lifespan
    starts it. No sampling defaults unless given (OpenAI's). `aliases`: more names requests may give it;
    `fields`: the other ServerState fields."""
    from chatserve.server.model_registry import ModelRegistry, PrebuiltParts
    from chatserve.server.model_specs import ModelSpec
    parts = PrebuiltParts(engine, tokenizer, sampling_defaults or {}, vocab_size)
    registry = ModelRegistry([ModelSpec(model_name, config, aliases)], prebuilt={model_name: parts})
    return ServerState(config=config, models=registry, **fields)
