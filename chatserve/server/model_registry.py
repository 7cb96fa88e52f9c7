"""ModelRegistry: the models one server serves, by name — which are configured, which are loaded — and
the request's way to its model: `lease(name)` loads it on demand (engine.model_pool.ModelPool) and maps
the pool's refusals onto the OpenAI error shape (404 unknown name, 503 no room / load failed).

Built once at startup (serve.py, or `single_model_state` in tests); the lifespan starts it (the default
model is loaded before the server reports ready) and drains every loaded model at shutdown.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from chatserve.config import DEFAULT_MODEL_ALIASES
from chatserve.engine.model_pool import Lease, LoadFailed, ModelInfo, ModelPool, NoRoom, PoolError, UnknownModel
from chatserve.server.errors import APIError
from chatserve.server.model_specs import ModelSpec
from chatserve.server.served_model import ServedModel, load_served, release_memory, unload_served

if TYPE_CHECKING:
    from chatserve.config import EngineConfig
    from chatserve.engine import AsyncEngine
    from chatserve.core.protocols import TokenizerLike

ModelLease = Lease[ServedModel]


@dataclass(frozen=True)
class PrebuiltParts:
    """Parts of the first load of a model built by the caller (serve.py's loaded engine, tests' fakes)."""

    engine: AsyncEngine
    tokenizer: TokenizerLike | None = None
    sampling_defaults: dict[str, Any] | None = None
    vocab_size: int | None = None


@dataclass
class ModelRegistry:
    specs: list[ModelSpec]                       # the first is the default model
    sizes: dict[str, int] = field(default_factory=dict)   # name → weights + KV bytes (0 = unknown)
    prebuilt: dict[str, PrebuiltParts] = field(default_factory=dict)
    on_load: list[Callable[[ServedModel], None]] = field(default_factory=list)
    kv_budget: int = 0                           # KV bytes the loaded models share (model_specs.shared_kv_budget)

    def __post_init__(self) -> None:
        first = self.specs[0].config
        sc = first.server
        self.default_name = self.specs[0].name
        self._started = False
        self._by_name = {s.name: s for s in self.specs}
        self._aliases: dict[str, str] = {}
        for s in self.specs:
            for alias in self._names_of(s):
                self._aliases.setdefault(alias, s.name)
        # a model whose engine was handed to us in single-model mode cannot be rebuilt: it stays
        pinned = tuple(self.prebuilt) if len(self.specs) == 1 else ()
        self.pool: ModelPool[ServedModel] = ModelPool(
            load=self._load, unload=unload_served, busy=lambda m: m.busy(),
            sizes={s.name: self.sizes.get(s.name, 0) for s in self.specs}, keep_alive=sc.keep_alive,
            max_loaded=sc.max_loaded_models, memory_budget=sc.model_memory_budget, pinned=pinned,
            release_memory=release_memory, kv_budget=self.kv_budget, kv_bytes=lambda m: m.kv_bytes)

    @staticmethod
    def _names_of(s: ModelSpec) -> set[str]:
        """Names a request may use: the served name, the file's own path and name, or for the default
        model its short names ("smollm2", as in the README)."""
        names = {s.name, *s.aliases}
        path = s.config.model.model
        if path:
            names.update({path, os.path.basename(path.rstrip("/"))})
        else:
            names.update(DEFAULT_MODEL_ALIASES)
        return names

    # ---- names ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def model_names(self) -> set[str]:
        return set(self._aliases)

    def resolve(self, name: str | None) -> str:
        """The served name a request's `model` means (None: the default model); 404 listing the names."""
        if name is None:
            return self.default_name
        served = self._aliases.get(name)
        if served is None:
            listed = ", ".join(f"'{n}'" for n in self.names())
            raise APIError(404, f"the model '{name[:200]}' does not exist; this server serves {listed}",
                           param="model", code="model_not_found")
        return served

    def spec(self, name: str) -> ModelSpec:
        return self._by_name[name]

    # ---- loading ---------------------------------------------------------------------------------
    def load_config(self, name: str, kv_share: int | None) -> EngineConfig:
        """The config `name` loads with: its spec's, with the KV share the pool gives it (None: its own)."""
        cfg = self._by_name[name].config
        return cfg if kv_share is None else cfg.replace_section("cache", kv_cache_memory=kv_share)

    async def _load(self, name: str, kv_share: int | None) -> ServedModel:
        cfg = self.load_config(name, kv_share)
        parts = self.prebuilt.pop(name, None) if len(self.specs) > 1 else self.prebuilt.get(name)
        if parts is None:
            served = await load_served(name, cfg)
        else:                                           # built with the first share (serve.py)
            served = await load_served(name, cfg, engine=parts.engine, tokenizer=parts.tokenizer,
                                       sampling_defaults=parts.sampling_defaults, vocab_size=parts.vocab_size)
        for hook in self.on_load:
            hook(served)
        return served

    async def lease(self, name: str | None, keep_alive: float | None = None) -> ModelLease:
        """The request's model, loaded (waiting for a load in progress). APIError 404/503."""
        served = self.resolve(name)
        try:
            return await self.pool.acquire(served, keep_alive)
        except UnknownModel as e:                       # resolve() already refused unknown names
            raise APIError(404, e.message, param="model", code="model_not_found") from None
        except NoRoom as e:
            raise APIError(503, e.message, code="model_memory_exceeded", retry_after=e.retry_after) from None
        except LoadFailed as e:
            raise APIError(503, e.message, code="model_load_failed", retry_after=1.0) from None
        except PoolError as e:
            raise APIError(503, e.message, code="service_unavailable", retry_after=e.retry_after or 5.0) from None

    def loaded(self) -> list[ServedModel]:
        return [m for _, m in self.pool.loaded()]

    def peek(self, name: str | None) -> ServedModel | None:
        """The model if it is loaded now (no load, no lease): progress, rewarm, metrics."""
        try:
            return self.pool.peek(self.resolve(name))
        except APIError:
            return None

    def info(self) -> list[ModelInfo]:
        return self.pool.info()

    async def start(self) -> None:
        """Load the default model (the server is ready once it is)."""
        lease = await self.lease(None)
        lease.release()
        self._started = True

    async def shutdown(self, drain_timeout: float) -> None:
        """Drain every loaded model (streams get `drain_timeout` s) and unload them."""
        async def drain(m: ServedModel) -> None:
            await unload_served(m, drain_timeout)
        await self.pool.close(drain)

    @property
    def ready(self) -> bool:
        """Started, not draining, and every loaded model's engine running."""
        return (self._started and not self.pool.closed
                and all(m.engine.ready for m in self.loaded()))

    @property
    def accepting(self) -> bool:
        return not self.pool.closed and all(m.engine.accepting for m in self.loaded())
