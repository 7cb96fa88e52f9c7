"""`chatserve serve` flag/env handling and the `chatserve chat` terminal client (on a fake server)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from chatserve.server.serve import build_parser, config_from_args, env_config, parse_bytes


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5G") == int(1.5 * (1 << 30))
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_flags_override_env_defaults():
    env = env_config({"CHATSERVE_BLOCK_SIZE": "32", "CHATSERVE_MAX_NUM_SEQS": "7",
                      "CHATSERVE_API_KEY": "k1,k2", "CHATSERVE_REDIS_URL": "redis://h:1/0"})
    args = build_parser().parse_args(["--kv-blocks", "48", "--max-num-seqs", "16",
                                      "--kv-cache-memory", "1GiB", "--api-key", "z"])
    cfg = config_from_args(args, env)
    assert cfg.cache.block_size == 32 and cfg.cache.num_blocks == 48
    assert cfg.cache.kv_cache_memory == 1 << 30
    assert cfg.scheduler.max_num_seqs == 16
    assert cfg.server.api_keys == ("z",) and cfg.server.redis_url == "redis://h:1/0"
    cfg2 = config_from_args(build_parser().parse_args([]), env)
    assert cfg2.server.api_keys == ("k1", "k2") and cfg2.scheduler.max_num_seqs == 7
    assert cfg2.cache.enable_prefix_caching
    assert not config_from_args(build_parser().parse_args(["--no-prefix-caching"]), env
                                ).cache.enable_prefix_caching


def _chatserve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chatserve.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_serve_help_reads_like_vllm_and_ignores_a_bad_environment():
    r = _chatserve("serve", "--help", env={"CHATSERVE_PORT": "abc"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--no-prefix-caching",
                 "--num-gpu-blocks-override", "--kv-blocks", "--allowed-origins", "--cors-origin",
                 "--uvicorn-log-level", "--gpu-memory-utilization", "--seed", "--generation-config",
                 "--chat-template", "--max-tokens-default", "--version", "MODEL"):
        assert flag in out, flag
    for group in ("model:", "KV cache:", "scheduler:", "server:"):
        assert group in out
    assert "(default: 8000; env $CHATSERVE_PORT)" in " ".join(out.split())
    assert "fp8_per_tensor" in out                              # the kernels' KV cache formats


def test_bad_environment_value_is_one_line_not_a_traceback():
    for var, value in (("CHATSERVE_PORT", "abc"), ("CHATSERVE_ENABLE_PREFIX_CACHING", "flase")):
        r = _chatserve("serve", env={var: value})
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"chatserve serve: {var}: "), r.stderr
        assert "Traceback" not in r.stderr


def test_version_and_bench_help():
    for argv in (("--version",), ("serve", "--version")):
        r = _chatserve(*argv)
        assert r.returncode == 0 and r.stdout.startswith("chatserve "), r
    r = _chatserve("bench", "--help")
    assert r.returncode == 0 and "sessions" in r.stdout and "memory" in r.stdout


def test_chat_client_streams_and_commands(fake_server):
    from chatserve.chat_client import run
    lines = iter(["abc", "/system be brief", "/clear", "/help", "/nope", "abc", "/quit"])
    out: list[str] = []
    args = argparse.Namespace(url=fake_server.url, api_key=None, model=None, system=None,
                              max_tokens=3, temperature=0.0)
    assert run(args, read=lambda prompt: next(lines), write=out.append) == 0
    text = "".join(out)
    assert "model fake-model" in text
    assert text.count("bot> def") == 2                    # "abc" → [1,0,1,2,2] → d e f
    assert "prompt 5 " in text and "prompt 14 " in text  # the second turn carries the system prompt
    assert "conversation cleared" in text and "/system TEXT" in text and "unknown command" in text
    assert "3 tokens" in text and "cached" in text


def test_chat_client_reports_http_errors(fake_server):
    from chatserve.chat_client import run
    lines = iter(["abc", "/quit"])
    out: list[str] = []
    args = argparse.Namespace(url=fake_server.url, api_key=None, model=None, system=None,
                              max_tokens=100000, temperature=None)
    run(args, read=lambda prompt: next(lines), write=out.append)
    assert "HTTP 400" in "".join(out)
