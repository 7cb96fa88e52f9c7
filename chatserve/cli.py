"""The `chatserve` command: a thin dispatcher to each subcommand's own module.

Subcommands import lazily, so `chatserve bench memory` never loads torch and `--help` is instant.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, str] = {
    "serve": "chatserve.server.serve:main",        # the API + UI server
    "chat": "chatserve.chat_client:main",          # terminal chat client
    "generate": "chatserve.generate:main",         # one completion on stdout
}
BENCH: dict[str, str] = {
    "memory": "chatserve.bench.memory:main",       # KV cache manager: waste, sharing, speed
    "scheduler": "chatserve.bench.scheduler:main", # scheduler overhead per step
    "model": "chatserve.bench.model:main",         # decode/prefill tokens/s
    "kernels": "chatserve.bench.kernels:main",     # GPU paged-attention bandwidth
    "serve": "chatserve.bench.serve:main",         # OpenAI-API serving benchmark
    "load": "chatserve.bench.load:main",           # load + cancellation + stream validation
    "sessions": "chatserve.bench.sessions:main",   # session-aware caching: turn N+1 hits under load
}

USAGE = """usage: chatserve {serve,chat,generate} [options]
       chatserve bench {memory,scheduler,model,kernels,serve,load,sessions} [options]
Run `chatserve COMMAND --help` for a command's options."""


def _run(target: str, argv: list[str]) -> int:
    mod, _, fn = target.partition(":")
    return int(getattr(importlib.import_module(mod), fn)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCH:
            print(USAGE, file=sys.stderr)
            return 2
        return _run(BENCH[rest[0]], rest[1:])
    if cmd not in COMMANDS:
        print(f"chatserve: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
        return 2
    return _run(COMMANDS[cmd], rest)


if __name__ == "__main__":
    sys.exit(main())
