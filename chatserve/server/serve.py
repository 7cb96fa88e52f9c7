"""`chatserve serve`: flags (CHATSERVE_* env as defaults) → load the model → banner → uvicorn.

SIGTERM/SIGINT: stop admitting, let streams finish up to --drain-timeout, end the rest, exit 0.
Not the app (app.py) and not the engine (engine.py).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from types import FrameType
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from chatserve import version
from chatserve.config import ConfigError, EngineConfig, ServerConfig, add_arguments, settings
from chatserve.config import parse_bytes  # noqa: F401  (re-exported: tests/server/test_server_cli.py imports it here)
from chatserve.config import config_from_args as apply_args
from chatserve.generation_defaults import load_generation_defaults
from chatserve.model_source import prepare_model
from chatserve.model_source.check import human_size
from chatserve.server.model_specs import (ModelSpec, check_unique, model_specs, parse_named, shared_kv_budget,
                                         split_model_values)
from chatserve.server.redis_check import redact_url

if TYPE_CHECKING:
    from chatserve.engine.deltas import EngineStats
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.server.model_registry import ModelRegistry
    from chatserve.server.served_model import ServedModel
    from chatserve.server.state import ServerState

log = logging.getLogger("chatserve.serve")


class Drainable(Protocol):
    async def shutdown(self, drain_timeout: float) -> None: ...

SOCKET_SEND_BUFFER = ServerConfig().socket_send_buffer   # the declared default (config.py)
DESCRIPTION = ("Serve a model over an OpenAI-compatible API and the web chat UI. Several models: "
               "--model NAME=PATH, repeated (loaded on first use; docs/multi-model.md). Every option can also "
               "be set by its CHATSERVE_* environment variable; a flag wins over the variable.")


def build_parser(env: EngineConfig | None = None) -> argparse.ArgumentParser:
    """The `chatserve serve` flags, generated from the config declarations (chatserve/config.py).

    `env` is unused (kept for callers that passed their defaults): defaults are applied by
    config_from_args, so a flag not given falls back to the environment, then to the declaration."""
    # "resolve": the declared --model (one value) is replaced by one that keeps every value given, so a
    # repeated --model NAME=PATH reaches argparse as it is (model_specs.split_model_values sorts them)
    p = argparse.ArgumentParser(prog="chatserve serve", description=DESCRIPTION, conflict_handler="resolve")
    p.add_argument("--version", action="version", version=f"chatserve {version()}")
    add_arguments(p)
    declared = next(s for s in settings("model") if s.name == "model")
    p.add_argument("--model", dest="model", action="append", default=argparse.SUPPRESS, metavar="[NAME=]MODEL",
                   help=f"{declared.option.help}; NAME=MODEL, repeatable, serves several models by name "
                   f"(docs/multi-model.md) (default: {declared.option.shown_default}; env "
                   f"{' or '.join('$' + v for v in declared.env_names)})")
    return p


def config_from_args(args: argparse.Namespace, env: EngineConfig | None = None) -> EngineConfig:
    """The flags given on the command line applied over `env` (defaults + CHATSERVE_* variables); a plain
    --model is the model, the --model NAME=PATH ones are configured()'s."""
    args, _ = split_model_values(args)
    return apply_args(args, env if env is not None else env_config())


def env_config(environ: dict[str, str] | None = None) -> EngineConfig:
    """The declared defaults with CHATSERVE_* overrides (ConfigError names a variable that does not parse)."""
    return EngineConfig.from_env(environ)


def served_name(cfg: EngineConfig) -> str:
    if cfg.model.served_model_name:
        return cfg.model.served_model_name
    path = cfg.model.resolved_model().rstrip("/")
    base = os.path.basename(path)
    for ext in (".gguf", ".safetensors"):
        if base.lower().endswith(ext):
            base = base[: -len(ext)]
    return base


def weights_text(runner) -> str:
    """How the weights are held: "Q4_1/Q8_0 in place, backend: cpu-avx512, decode rows on a row-interleaved
    copy (97 MiB beside the mapped file)", or the repack."""
    formats = getattr(runner, "block_formats", None)
    if not formats:
        return runner.weight_quant or "dense"
    copy = runner.model.block_copy_bytes() if hasattr(runner.model, "block_copy_bytes") else 0
    tiled = f", decode rows on a row-interleaved copy ({copy / 2**20:.0f} MiB beside the mapped file)" if copy else ""
    return f"{'/'.join(formats)} in place, backend: {runner.block_backend.name}{tiled}"


def model_lines(served: ServedModel, load_s: float) -> list[str]:
    """What one loaded model is: file, dtype and weights, backends, its KV cache (its share of the
    budget), context and max_tokens default."""
    engine, cfg = served.engine, served.config
    runner: ModelRunner = engine.runner     # type: ignore[assignment]  # serve always builds a real one
    dtype = str(runner.dtype).replace("torch.", "")
    kv_dtype = dtype if runner.kv_cache_dtype == "auto" else runner.kv_cache_dtype
    blocks, bs, ctx = engine.num_blocks, engine.block_size, engine.max_model_len
    tokens = blocks * bs
    mem = runner.bytes_per_block * blocks
    max_tokens = served.default_max_tokens
    max_tokens_text = (f"{max_tokens:,} tokens ({served.default_max_tokens_source})" if max_tokens
                       else "the rest of the context (set --max-tokens-default)")
    return [
        f"  model      {cfg.model.resolved_model()}",
        f"  dtype      {dtype} on {runner.device}, weights {weights_text(runner)}, KV {kv_dtype}"
        f"   (loaded in {load_s:.1f} s)",
        f"  backends   {runner.model.describe_backends()}; "
        f"batch-invariant {'on' if runner.batch_invariant else 'off (--no-batch-invariant)'}",
        f"  KV cache   {blocks} blocks × {bs} tokens = {tokens:,} tokens ({mem / (1 << 20):.0f} MiB"
        f"{', resident as blocks are used' if str(runner.device).startswith('cpu') else ''})"
        f", prefix caching {'on' if cfg.cache.enable_prefix_caching else 'off'}",
        f"  context    {ctx:,} tokens; {tokens / max(1, ctx):.1f} sequences fit at full context; "
        f"max {cfg.scheduler.max_num_seqs} running, {cfg.scheduler.max_waiting_requests} waiting",
        f"  max_tokens default {max_tokens_text}",
    ]


def models_lines(state: ServerState) -> list[str]:
    """With several models: each one's name, path, status and KV share, and the loading rules."""
    reg, sc = state.models, state.config.server
    if len(reg.specs) < 2:
        return []
    keep = ("never unloaded when idle" if sc.keep_alive < 0 else f"unloaded after {sc.keep_alive:g} s idle")
    budget = f", model memory budget {human_size(sc.model_memory_budget)}" if sc.model_memory_budget else ""
    out = [f"  models     {len(reg.specs)} served, at most {sc.max_loaded_models} loaded at once{budget}; "
           f"{keep} (--keep-alive)"]
    pool = reg.pool
    if pool.kv_budget:
        out.append(f"  KV budget  {human_size(pool.kv_budget)} shared, {human_size(pool.kv_free)} free: a load "
                   f"gets the free budget ÷ the empty slots; an unload gives its share back")
    for info in reg.info():
        spec = reg.spec(info.name)
        if info.kv_bytes:
            kv = f"its KV cache {human_size(info.kv_bytes)}"
        elif pool.kv_budget:
            kv = f"a KV share of {human_size(pool.kv_share(info.name) or 0)} if it loaded now"
        else:
            kv = f"its KV cache {human_size(spec.config.cache.kv_cache_memory)}"
        out.append(f"    {info.name:<20} {info.phase:<9} {spec.config.model.resolved_model()}  "
                   f"(~{human_size(info.size)}; {kv})")
    return out


def banner(cfg: EngineConfig, state: ServerState, load_s: float) -> str:
    """The startup summary: what was loaded, how the KV cache is sized, where to connect."""
    host = cfg.server.host
    shown = "localhost" if host in ("0.0.0.0", "::", "127.0.0.1") else host
    base = f"http://{shown}:{cfg.server.port}"
    sessions = (f"Redis at {redact_url(cfg.server.redis_url)}" if cfg.server.redis_url
                else "in-process memory (NOT persisted; set --redis-url)")
    default = state.models.peek(None)
    lines = [
        "",
        f"  chatserve · {state.model_name}",
        *(model_lines(default, load_s) if default is not None else []),
        *models_lines(state),
        f"  API        {base}/v1  (OpenAI-compatible; WebSocket {base.replace('http', 'ws')}/v1/ws)",
        f"  UI         {base}/",
        f"  metrics    {base}/metrics",
        f"  auth       {len(cfg.server.api_keys)} API key(s)" if cfg.server.api_keys else "  auth       none (open)",
        f"  sessions   {sessions}",
        *([state.redis_check.banner_line()] if state.redis_check else []),
        "",
    ]
    return "\n".join(lines)


class StatsLine:
    """Prints throughput, queue, KV usage and prefix hit rate of each loaded model every `interval` s
    while it is busy."""

    def __init__(self, models: ModelRegistry, interval: float) -> None:
        self.models, self.interval = models, interval
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.interval > 0:
            self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        prev: dict[int, tuple[EngineStats, float]] = {}
        several = len(self.models.specs) > 1
        while True:
            await asyncio.sleep(self.interval)
            for served in self.models.loaded():
                s, now = served.engine.stats(), time.monotonic()
                key = id(served.engine)
                p, t_prev = prev.get(key, (s, now - self.interval))
                prev[key] = (s, now)
                dt = max(1e-6, now - t_prev)
                if s.running or s.waiting or s.generation_tokens != p.generation_tokens:
                    dq = s.prefix_queries - p.prefix_queries
                    hit = (s.prefix_hits - p.prefix_hits) / dq if dq else 0.0
                    who = f" {served.name}:" if several else ""
                    print(f"[stats]{who} gen {(s.generation_tokens - p.generation_tokens) / dt:7.1f} tok/s · "
                          f"prompt {(s.prompt_tokens - p.prompt_tokens) / dt:7.1f} tok/s · "
                          f"running {s.running} waiting {s.waiting} · KV {s.kv_usage:5.1%} · "
                          f"prefix hit {hit:5.1%} · preemptions {s.preemptions}", flush=True)


def warm_tokenizer_process(served: ServedModel) -> None:
    """Spawn a loaded model's tokenizer process in the background, not at its first big prompt."""
    proc = served.prompt_guard.process
    if proc is not None:
        asyncio.get_running_loop().run_in_executor(None, proc.start)


def warm_chat_renderer(served: ServedModel) -> None:
    """Import the chat template renderer in the background, not at the first chat request."""
    from chatserve.text.chat_template import import_renderer
    asyncio.get_running_loop().run_in_executor(None, import_renderer)


def exit_reserve(drain_timeout: float) -> float:
    """Seconds of the drain timeout kept for closing sockets and exiting (at most 1 s, a quarter)."""
    return min(1.0, 0.25 * max(0.0, drain_timeout))


def set_nodelay(transport) -> None:
    """TCP_NODELAY on an accepted connection: without it Nagle's algorithm holds a small write (the
    body after the headers, an SSE event) until the client's delayed ACK, ~40 ms on a kept-alive one."""
    import socket
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def nodelay_http_protocol() -> type:
    """uvicorn's HTTP protocol with TCP_NODELAY set when a connection is accepted (a WebSocket
    upgrade keeps the connection, so it has it too). asyncio sets it itself only for sockets created
    with proto=IPPROTO_TCP, and uvicorn's bind_socket creates them with proto 0."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # uvicorn picks the class at runtime
        def connection_made(self, transport) -> None:
            set_nodelay(transport)
            super().connection_made(transport)

    return NoDelayHTTPProtocol


def make_server(app, cfg: EngineConfig, models: Drainable):
    """uvicorn's server whose first SIGTERM/SIGINT drains `models` (the registry: every loaded model;
    or one engine) before it exits."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """First SIGTERM/SIGINT drains every model, then exits; a second one forces exit."""

        draining = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.draining:
                self.force_exit = True
                self.should_exit = True
                return
            self.draining = True
            loop = getattr(self, "_loop", None)
            if loop is None:
                self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(sig)))

        async def _drain(self, sig: int) -> None:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            print(f"[chatserve] {name}: draining (up to {cfg.server.drain_timeout:.0f} s), "
                  f"no new requests", flush=True)
            try:
                # streams get the drain timeout less a small reserve for closing, so the whole
                # process is gone within --drain-timeout (main() skips the slow interpreter teardown)
                drain = cfg.server.drain_timeout
                await models.shutdown(max(0.0, drain - exit_reserve(drain)))
                await asyncio.sleep(0.3)          # let the last events reach their clients
            finally:
                self.should_exit = True

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    # X-Forwarded-For is believed only from the proxies named by --forwarded-allow-ips: the client
    # address is a cache-isolation identity for keyless callers (identity.py), so it must not be
    # something any local process can claim (uvicorn would trust 127.0.0.1 by default).
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port,
                            log_level=cfg.server.uvicorn_log_level,
                            ws_max_size=cfg.server.max_body_bytes + 4096, timeout_graceful_shutdown=5,
                            timeout_keep_alive=15, access_log=False, http=nodelay_http_protocol(),
                            proxy_headers=bool(cfg.server.forwarded_allow_ips),
                            forwarded_allow_ips=cfg.server.forwarded_allow_ips or None)
    return DrainingServer(config)


def listener(config, send_buffer: int):
    """The listening socket, bound by uvicorn's own code, with SO_SNDBUF set for every connection."""
    import socket
    sock = config.bind_socket()
    if send_buffer > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    return sock


def configured(argv: list[str] | None) -> tuple[EngineConfig, list[ModelSpec]]:
    """The flags and environment → the server's config and its models (each resolved to a local path and
    checked; ConfigError, FileNotFoundError or ValueError name what is wrong). --help and --version exit
    here, before the environment is read."""
    args, named = split_model_values(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    base = config_from_args(args, env_config())
    specs = []
    for spec in model_specs(base, [*parse_named(base.server.models), *named]):
        cfg = prepare_model(spec.config)               # a name → a local path, files checked
        specs.append(replace(spec, name=spec.name or served_name(cfg), config=cfg))
    return base, check_unique(specs)


def model_size(cfg: EngineConfig) -> int:
    """Bytes a model takes loaded, as far as its files tell: weights as stored + its KV cache share."""
    from chatserve.model_source.check import check_files, kv_cache_bytes
    checked = check_files(cfg.model.resolved_model())
    return checked.weight_bytes + kv_cache_bytes(checked.config, cfg.cache, cfg.model.dtype)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, specs = configured(argv)
        sizes = {sp.name: model_size(sp.config) for sp in specs}
        first = specs[0].config
        from chatserve.runtime.weights import gguf_reader
        generation_defaults = load_generation_defaults(first.model, gguf_reader)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"chatserve serve: {e}", file=sys.stderr)
        return 2
    sc = cfg.server
    logging.basicConfig(level=sc.log_level.upper() if sc.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sc.gil_switch_interval > 0:
        sys.setswitchinterval(sc.gil_switch_interval)

    from chatserve.engine import AsyncEngine
    from chatserve.server.app import build_app
    from chatserve.server.model_registry import ModelRegistry, PrebuiltParts
    from chatserve.server.state import ServerState

    print(f"[chatserve] loading {first.model.resolved_model()} ({first.model.dtype}) ...", flush=True)
    t0 = time.perf_counter()
    engine = AsyncEngine(first)
    try:
        engine.load(progress=True)
    except Exception as e:
        print(f"chatserve serve: could not load the model: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if engine.warm_up_seconds is not None:
        print(f"[chatserve] warm-up: kernels compiled, one dummy prefill + decode ran in "
              f"{engine.warm_up_seconds:.2f} s; ready for requests", flush=True)
    registry = ModelRegistry(specs, sizes=sizes, prebuilt={
        specs[0].name: PrebuiltParts(engine, sampling_defaults=generation_defaults)},
        kv_budget=shared_kv_budget(cfg, specs))
    registry.on_load.append(warm_tokenizer_process)
    registry.on_load.append(warm_chat_renderer)
    state = ServerState(config=cfg, models=registry)
    stats = StatsLine(registry, sc.stats_interval)
    state.startup_hooks.append(stats.start)
    state.shutdown_hooks.append(stats.stop)
    if cfg.server.redis_url:
        from chatserve.server.redis_check import RedisCheck
        state.redis_check = RedisCheck(cfg.server.redis_url)
        state.redis_check.check_sync()      # a wrong password shows here, not at the first chat
    app = build_app(state)
    load_s = time.perf_counter() - t0

    async def show_banner() -> None:        # after the lifespan started the default model
        print(banner(cfg, state, load_s), flush=True)
    state.startup_hooks.append(show_banner)
    server = make_server(app, cfg, registry)
    server.run(sockets=[listener(server.config, sc.socket_send_buffer)])
    print("[chatserve] stopped", flush=True)
    if server.draining:
        # a signal ended a clean shutdown (every model drained, shutdown hooks run): skip the second or
        # so of interpreter teardown (torch, thread pools) so the process exits within --drain-timeout
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
