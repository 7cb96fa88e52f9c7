"""Keyless callers do not share cached prefix blocks across client identities (issue 14 item 3): two
clients on different loopback addresses against a real `chatserve serve` without keys (tiny model).
The client address is the identity; a forged X-Forwarded-For does not move a caller into another's
cache; one browser cookie is one identity on the WebSocket; --share-prefix-cache shares on purpose."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from chatserve.server.identity import cache_salt

pytestmark = pytest.mark.timeout(300)
PROMPT = " ".join(f"The private note number {i} says the vault code is {i * 7919 % 10000}." for i in range(40))


def _cached(url: str, source: str, prompt: str = PROMPT, headers: dict | None = None) -> int:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=url, transport=transport, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                   headers=headers or {})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] > 100
        return usage["prompt_tokens_details"]["cached_tokens"]


def test_keyless_clients_do_not_share_cached_prefixes(tiny_server):
    url = tiny_server.url
    prompt = PROMPT + " (http)"
    assert _cached(url, "127.0.0.2", prompt) == 0
    assert _cached(url, "127.0.0.3", prompt) == 0                 # another client: no hit
    # claiming the first client's address in a header does not help: no proxy is trusted by default
    assert _cached(url, "127.0.0.4", prompt, headers={"X-Forwarded-For": "127.0.0.2"}) == 0
    assert _cached(url, "127.0.0.2", prompt) > 100                # the same client: hit


def _ws_cached(url: str, cookie: str | None, prompt: str) -> int:
    headers = {"Cookie": f"chatserve_uid={cookie}"} if cookie else {}
    with ws_connect(url.replace("http", "ws") + "/v1/ws", additional_headers=headers) as ws:
        ws.send(json.dumps({"id": "q", "type": "completions", "prompt": prompt, "max_tokens": 1,
                            "stream_options": {"include_usage": True}}))
        cached = None
        while True:
            m = json.loads(ws.recv(timeout=60))
            if m["type"] == "chunk" and m["chunk"].get("usage"):
                cached = m["chunk"]["usage"]["prompt_tokens_details"]["cached_tokens"]
            if m["type"] in ("done", "error"):
                assert m["type"] == "done", m
                break
        assert cached is not None
        return cached


def test_websocket_browser_identities_do_not_share(tiny_server):
    url = tiny_server.url
    prompt = PROMPT + " (ws)"
    assert _ws_cached(url, "A" * 32, prompt) == 0
    assert _ws_cached(url, "B" * 32, prompt) == 0
    assert _ws_cached(url, "A" * 32, prompt) > 100


def test_share_prefix_cache_flag_means_one_salt():
    from chatserve.config import EngineConfig, ServerConfig
    own = SimpleNamespace(session_secret=b"s" * 32, config=EngineConfig())
    shared = SimpleNamespace(session_secret=b"s" * 32,
                             config=EngineConfig(server=ServerConfig(share_prefix_cache=True)))
    assert cache_salt(own, "client:127.0.0.2") != cache_salt(own, "client:127.0.0.3")
    assert cache_salt(shared, "client:127.0.0.2") is None and cache_salt(shared, "key:x") is None
