"""The one way to turn an `EngineConfig` into an engine's parts: model runner, tokenizer, KV cache manager
and scheduler, used by both the offline `LLM` and the server's `AsyncEngine`.

Not the step loop (engine.py, llm.py) and not the parts themselves; parts given ready-made are kept.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatserve.config import EngineConfig
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.protocols import KVCache, Runner, SchedulerLike, TokenizerLike
from chatserve.core.scheduler import Scheduler

if TYPE_CHECKING:
    from chatserve.runtime.model_runner import ModelRunner

log = logging.getLogger("chatserve.engine.builder")


@dataclass
class EngineParts:
    runner: Runner
    tokenizer: TokenizerLike | None
    kv: KVCache
    scheduler: SchedulerLike
    max_model_len: int
    warm_up_seconds: float | None = None   # None: no warm-up ran


def effective_max_model_len(config: EngineConfig, runner: Runner) -> int:
    """The runner's context length, capped by --max-model-len."""
    cap = config.scheduler.max_model_len
    own = int(runner.max_model_len)
    return min(own, cap) if cap else own


def build_runner(config: EngineConfig, *, progress: bool = False) -> "ModelRunner":
    """Load the model and allocate its KV cache (blocking; torch is imported here)."""
    from chatserve.runtime.model_runner import ModelRunner
    return ModelRunner.from_config(config, progress=progress)


def load_tokenizer(config: EngineConfig) -> TokenizerLike:
    """The model's tokenizer, under --chat-template when one is given."""
    from chatserve.text import Tokenizer, load_chat_template
    tok = Tokenizer.from_model(config.model.resolved_model())
    if config.model.chat_template:
        tok = tok.with_chat_template(load_chat_template(config.model.chat_template))
    return tok


def build_scheduler(config: EngineConfig, runner: Runner, max_model_len: int,
                    model_key: str = "") -> tuple[KVCacheManager, Scheduler]:
    """The KV cache manager over the runner's blocks, and the scheduler that owns it."""
    cc = config.cache
    kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching=cc.enable_prefix_caching,
                        watermark=cc.watermark, hash_seed=cc.hash_seed, model_key=model_key,
                        sliding_window=runner.kv_window)
    return kv, Scheduler(config.scheduler, kv, max_model_len=max_model_len)


def build_engine_parts(config: EngineConfig, *, runner: Runner | None = None,
                       tokenizer: TokenizerLike | None = None, kv: KVCache | None = None,
                       scheduler: SchedulerLike | None = None, with_tokenizer: bool = True,
                       warm_up: bool = False, progress: bool = False) -> EngineParts:
    """Every part not given, built from `config`. warm_up: run the runner's dummy prefill + decode
    (kernel compilation) before returning, so the first request does not pay for it."""
    warm_up_runner = None
    if runner is None:
        runner = warm_up_runner = build_runner(config, progress=progress)
    if tokenizer is None and with_tokenizer:
        tokenizer = load_tokenizer(config)
    built: Runner = runner
    max_len = effective_max_model_len(config, built)
    if scheduler is None:
        kv, scheduler = build_scheduler(config, built, max_len, built.model_key)
    elif kv is None:
        kv = scheduler.kv   # type: ignore[attr-defined]  # a ready scheduler without kv=: it must carry its own (Scheduler.kv; fakes too)
    parts = EngineParts(built, tokenizer, kv, scheduler, max_len)
    if warm_up and warm_up_runner is not None:     # a runner given ready-made is the caller's to warm
        parts.warm_up_seconds = warm_up_runner.warm_up()
        log.info("warm-up: kernels compiled, one dummy prefill + decode ran in %.2f s",
                 parts.warm_up_seconds)
    return parts
