"""The `chatserve` command: a thin dispatcher to each subcommand's own module.

Subcommands import lazily, so `chatserve bench memory` never loads torch and `--help` is instant.
"""
from __future__ import annotations

import importlib
import sys

from chatserve import version

COMMANDS: dict[str, str] = {
    "serve": "chatserve.server.serve:main",        # the API + UI server
    "chat": "chatserve.chat_client:main",          # terminal chat client
    "generate": "chatserve.generate:main",         # one completion on stdout
    "models": "chatserve.model_source.command:main",   # local models by name; pull one
}
BENCH_HELP: dict[str, str] = {                     # `chatserve bench NAME` → what it measures
    "memory": "KV cache manager: waste, sharing, speed",
    "scheduler": "scheduler overhead per step",
    "model": "decode/prefill tokens/s",
    "kernels": "GPU paged-attention bandwidth",
    "blockmm": "CPU matmul on GGUF block formats vs today's paths",
    "invariance": "what --batch-invariant costs a mixed step, and serving",
    "turn": "cached-prefix chat turn: step time by op class vs a decode step",
    "quality": "GGUF: logits vs transformers on the file's weights (and llama.cpp)",
    "launch": "GGUF: load time, peak RSS, decode step of chatserve and llama.cpp on one file",
    "serve": "OpenAI-API serving benchmark",
    "load": "load + cancellation + stream validation",
    "sessions": "session-aware caching: turn N+1 hits under load",
    "models": "model switching: cold vs warm TTFT, two models alternating",
    "build-model": "random-weight checkpoint of a real shape (Llama-3.2-1B)",
    "build-gguf": "random-block GGUF of a 1B, 8B or MoE shape in one format or Q4_K_M",
}
BENCH: dict[str, str] = {name: f"chatserve.bench.{name}:main" for name in BENCH_HELP}
BENCH["build-model"] = "chatserve.bench.checkpoint:main"
BENCH["build-gguf"] = "chatserve.bench.gguf_checkpoint:main"

USAGE = ("usage: chatserve {serve,chat,generate,models} [options]\n"
         "       chatserve bench {" + ",".join(BENCH) + "} [options]\n"
         "       chatserve --version\n"
         "Run `chatserve COMMAND --help` for a command's options.")
BENCH_USAGE = ("usage: chatserve bench {" + ",".join(BENCH) + "} [options]\n"
               + "\n".join(f"  {name:<10} {desc}" for name, desc in BENCH_HELP.items())
               + "\nRun `chatserve bench NAME --help` for a benchmark's options.")


def _run(target: str, argv: list[str]) -> int:
    mod, _, fn = target.partition(":")
    return int(getattr(importlib.import_module(mod), fn)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"chatserve {version()}")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(BENCH_USAGE)
            return 0
        if not rest or rest[0] not in BENCH:
            print(BENCH_USAGE, file=sys.stderr)
            return 2
        return _run(BENCH[rest[0]], rest[1:])
    if cmd not in COMMANDS:
        print(f"chatserve: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
        return 2
    return _run(COMMANDS[cmd], rest)


if __name__ == "__main__":
    sys.exit(main())
