"""Smoke test of both benchmark tools against a real `chatserve serve` (tiny random model, small KV)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chatserve.bench import load, serve
from fake_openai import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from chatserve.runtime.tiny import make_tiny_model
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "chatserve.cli", "serve", "--model", model,
                                 "--port", str(port), "--kv-blocks", "128", "--stats-interval", "0"],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.25)
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_bench_serve_multi_turn_on_chatserve(real_server, capsys):
    rc = serve.main(["--url", real_server, "--json", "--no-progress", "--workload", "multi-turn",
                     "--conversations", "2", "--turns", "3", "--turn-len", "24", "--output-len", "4",
                     "--ignore-eos", "--concurrency", "2"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["completed"] == 6, r
    assert r["output_tokens"] == 24  # ignore_eos: exactly max_tokens each
    assert r["prefix_cache_hit_rate"] is not None and r["prefix_cache_hit_rate"] > 0.3
    assert r["usage_cached_fraction_turn2plus"] > 0.5
    assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p50"] > 0


def test_bench_load_on_chatserve(real_server, capsys):
    rc = load.main(["--url", real_server, "--json", "--duration", "20", "--max-requests", "16",
                    "--concurrency", "4", "--cancel-fraction", "0.5", "--max-tokens", "4:16",
                    "--prompt-len", "4:40", "--ignore-eos"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0, r
    assert r["accepted"] == 16 and r["lost"] == 0 and r["server_errors"] == 0
    assert r["completed"] + r["cancelled"] == 16 and r["cancelled"] > 0
    assert r["leaked_blocks"] == 0
