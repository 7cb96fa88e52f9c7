"""`chatserve generate`: one completion printed on stdout (and nothing else), through the offline
LLM driver — the same scheduler / KV cache manager / model runner path the server uses.

Not a chat REPL (see `chatserve chat`); loading messages go to stderr.
"""
from __future__ import annotations

import argparse
import sys

from chatserve.config import ConfigError, EngineConfig, add_arguments, config_from_args
from chatserve.model_source import prepare_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatserve generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", required=True, help="prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="show the weight-loading progress bar")
    add_arguments(p, sections=("model",))     # --model, --dtype, --device, --seed, … as `chatserve serve`
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        print("chatserve generate: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    from chatserve.core.request import SamplingParams
    from chatserve.engine.builder import load_tokenizer
    from chatserve.engine.llm import LLM

    try:
        # a name → a local path, files checked
        config = prepare_model(config_from_args(args, EngineConfig.from_env(), sections=("model",)),
                               count_kv_cache=False)
        path = config.model.resolved_model()
        tok = load_tokenizer(config)               # the builder's one way: --chat-template applies
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"chatserve generate: {e}", file=sys.stderr)
        return 2
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = list(tok.apply_chat_template(messages))
    else:
        ids = tok.encode(args.prompt)
    # a KV cache sized to this one request (plus a block of slack), not the server's default budget
    block_size = config.cache.block_size
    config = config.replace_section("cache", num_blocks=(len(ids) + args.max_tokens) // block_size + 2)
    from chatserve.runtime.arch_config import UnsupportedModelError
    try:
        llm = LLM(config=config, progress=args.progress, eos_token_ids=sorted(set(tok.eos_token_ids)))
    except UnsupportedModelError as e:
        print(f"chatserve generate: cannot run {path}: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=config.model.seed)
    out = llm.generate([ids], params)[0]
    eos = set(tok.eos_token_ids)
    while out and out[-1] in eos:
        out = out[:-1]
    sys.stdout.write(tok.decode(out) + "\n")
    sys.stdout.flush()
    return 0
