"""ServedModel: one loaded model with everything a request to it reads — its engine (own KV cache and
prefix cache), tokenizer, sampling defaults, prompt bound — built once when it loads, then frozen.

`load_served` builds one (the engine loads on its own step thread, off the event loop); `unload_served`
drains and drops it. Which models are loaded is the registry's business (model_registry.py).
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatserve.config import EngineConfig
from chatserve.core.protocols import TokenizerLike
from chatserve.server.prompt_guard import PromptGuard
from chatserve.server.shared_prompts import SharedPrompts

if TYPE_CHECKING:
    from chatserve.engine import AsyncEngine


@dataclass(frozen=True)
class ServedModel:
    name: str
    config: EngineConfig                     # this model's: its path, its share of the KV cache budget
    engine: AsyncEngine
    tokenizer: TokenizerLike                 # big encodes run in the prompt guard's helper process
    prompt_guard: PromptGuard
    vocab_size: int | None = None
    # SamplingParams field → value from the model's generation config (--generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    shared_prompts: SharedPrompts | None = None
    load_seconds: float = 0.0

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def kv_tokens(self) -> int:
        """Token slots in this model's KV cache (0 = unknown): no one sequence can be longer."""
        return self.engine.num_blocks * self.engine.block_size

    @property
    def kv_bytes(self) -> int:
        """Bytes of this model's KV cache (0 = unknown: an engine without a real runner)."""
        per_block = int(getattr(self.engine.runner, "bytes_per_block", 0) or 0)
        return per_block * int(self.engine.num_blocks)

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
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def busy(self) -> bool:
        """Requests are queued or running on it (it must not be unloaded)."""
        return self.engine.stats().active_requests > 0


def _vocab_size(tokenizer: TokenizerLike) -> int | None:
    size = int(getattr(tokenizer, "vocab_size", 0) or 0)
    return size if size > 0 else None


async def load_served(name: str, cfg: EngineConfig, *, engine: AsyncEngine | None = None,
                      tokenizer: TokenizerLike | None = None, sampling_defaults: dict[str, Any] | None = None,
                      vocab_size: int | None = None) -> ServedModel:
    """The model `cfg` names, loaded and started. The weights load on the engine's step thread and the
    tokenizer's bounds in a worker thread, so the event loop (other models' streams) runs meanwhile.
    Parts given (an engine built by the caller, a test's fakes) are used as they are."""
    t0 = time.perf_counter()
    if engine is None:
        from chatserve.engine import AsyncEngine
        engine = AsyncEngine(cfg)
    try:
        await engine.start()
        if sampling_defaults is None:
            sampling_defaults = await asyncio.to_thread(_generation_defaults, cfg)
        tok = tokenizer if tokenizer is not None else engine.tokenizer
        assert tok is not None                  # start() loaded it
        guard = await asyncio.to_thread(PromptGuard, tok, int(engine.max_model_len))
    except BaseException:
        await engine.shutdown(0.0)
        raise
    shared = (SharedPrompts(cfg.server.shared_system_prompts, guard.tokenizer)
              if cfg.server.shared_system_prompts else None)
    return ServedModel(name=name, config=cfg, engine=engine, tokenizer=guard.tokenizer, prompt_guard=guard,
                       vocab_size=vocab_size or _vocab_size(tok), sampling_defaults=dict(sampling_defaults),
                       shared_prompts=shared, load_seconds=time.perf_counter() - t0)


def _generation_defaults(cfg: EngineConfig) -> dict[str, Any]:
    from chatserve.generation_defaults import load_generation_defaults
    from chatserve.runtime.weights import gguf_reader
    return load_generation_defaults(cfg.model, gguf_reader)


async def unload_served(served: ServedModel, drain_timeout: float = 0.0) -> None:
    """Drain its engine (streams get `drain_timeout` s), stop its tokenizer process, free its memory."""
    await served.engine.shutdown(drain_timeout)
    served.prompt_guard.close()


async def release_memory() -> None:
    """Once an unloaded model is unreferenced: a full garbage collection (its engine's parts refer to each
    other, so its weights and KV cache are freed by the collector, not by refcounts), then glibc's
    malloc_trim, which hands the freed heap back to the system (without it the process keeps it, and
    every switch of models grows it). Off the event loop."""
    await asyncio.to_thread(_collect_and_trim)


def _collect_and_trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc: the allocator keeps what it keeps
        pass
