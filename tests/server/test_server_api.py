"""The HTTP API on a fake engine (real uvicorn, real openai client): formats, validation, limits,
auth, rate limits, cache-salt isolation, metrics, disconnects. Runs in seconds; no weights."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_support import away_from_a_minute_boundary, metric, poll_metrics, raw_post, start_fake_server

MSG = [{"role": "user", "content": "abc"}]


@pytest.fixture
def client(shared_fake_server):
    return openai.OpenAI(base_url=shared_fake_server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


# ---- formats ------------------------------------------------------------------------------------
def test_chat_non_stream(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=5)
    # prompt ids [1, 0, 1, 2, 2] → greedy fake: 3, 4, 5, 6, 7
    assert r.object == "chat.completion" and r.choices[0].message.content == "defgh"
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5 and r.usage.total_tokens == 10
    ext = r.usage.model_extra["chatserve"]
    assert set(ext) == {"ttft_s", "tokens_per_s", "queue_s"} and ext["ttft_s"] >= 0


def test_default_model_answers_to_its_short_names(client):
    # the README's quickstart says model="smollm2"; the served name stays the file's own
    for name in ("smollm2", "SmolLM2-135M-Instruct", "fake-model"):
        r = client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model == name and r.choices[0].finish_reason == "length"


def test_chat_stream_shape_n2_and_usage(client):
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    roles: dict[int, list] = {0: [], 1: []}
    for c in chunks[:-1]:
        for ch in c.choices:
            roles[ch.index].append(ch.delta.role)
            text[ch.index] += ch.delta.content or ""
            finishes[ch.index] += ch.finish_reason is not None
    assert text == {0: "defg", 1: "defg"} and finishes == {0: 1, 1: 1}
    # each choice's first chunk carries the role together with its first token (no empty role chunk)
    assert all(r[0] == "assistant" and set(r[1:]) <= {None} for r in roles.values())
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "d"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_stream_without_include_usage_has_no_usage_chunk_and_done_last(shared_fake_server):
    r = httpx.post(shared_fake_server.url + "/v1/chat/completions",
                   json={"messages": MSG, "max_tokens": 3, "stream": True}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]"
    objs = [json.loads(e) for e in ev[:-1]]
    assert all(o["choices"] for o in objs)
    assert sum(ch["finish_reason"] is not None for o in objs for ch in o["choices"]) == 1


def test_stop_string_and_logprobs(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=10, stop=["g"],
                                       logprobs=True, top_logprobs=1)
    assert r.choices[0].message.content == "def" and r.choices[0].finish_reason == "stop"
    lp = r.choices[0].logprobs.content
    assert lp[0].token == "d" and lp[0].logprob == -0.5 and len(lp[0].top_logprobs) == 2


def test_completions_stream_and_non_stream(client):
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=3, logprobs=1)
    assert r.object == "text_completion" and r.choices[0].text == "def"
    assert r.choices[0].logprobs.tokens == ["d", "e", "f"]
    assert r.choices[0].logprobs.text_offset == [0, 1, 2]
    s = list(client.completions.create(model="fake-model", prompt=[0, 1], max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in s) == "cde"
    assert s[-1].choices[0].finish_reason == "length"


def test_second_identical_request_reports_cached_tokens(client):
    msgs = [{"role": "user", "content": "cached prompt here"}]
    a = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=2)
    b = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=2)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens > 0


def test_models_health_ready_tokenize_openapi(shared_fake_server):
    u = shared_fake_server.url
    m = httpx.get(u + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "fake-model"
    assert httpx.get(u + "/health").json() == {"status": "ok"}
    assert httpx.get(u + "/ready").status_code == 200
    t = httpx.post(u + "/tokenize", json={"prompt": "abc"}).json()
    assert t["tokens"] == [0, 1, 2] and t["count"] == 3
    assert httpx.post(u + "/detokenize", json={"tokens": [0, 1, 2]}).json() == {"prompt": "abc"}
    spec = httpx.get(u + "/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "/v1/chat/completions" in spec["paths"]


def test_metrics_names(shared_fake_server):
    text = httpx.get(shared_fake_server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket"):
        assert f"chatserve:{name}" in text, name


# ---- invalid requests: exact status and OpenAI error shape -------------------------------------
BIG = "x" * (2 << 20)
INVALID = [
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ({"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ({"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MSG, "top_p": 0}, 400, "top_p"),
    ({"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ({"messages": MSG, "n": 0}, 400, "n"),
    ({"messages": MSG, "n": 17}, 400, "n"),
    ({"messages": MSG, "n": True}, 400, "n"),
    ({"messages": MSG, "n": 2.5}, 400, "n"),
    ({"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MSG, "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ({"messages": MSG, "stop": [1]}, 400, "stop"),
    ({"messages": MSG, "stop": [""]}, 400, "stop"),
    ({"messages": MSG, "stop": ["a"] * 17}, 400, "stop"),
    ({"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"messages": MSG, "logit_bias": [1]}, 400, "logit_bias"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": MSG, "stream": True, "stream_options": [1]}, 400, "stream_options"),
    ({"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty"),
    ({"messages": MSG, "min_p": 2}, 400, "min_p"),
    ({"messages": MSG, "seed": 2 ** 70}, 400, "seed"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": MSG, "model": "gpt-4"}, 404, "model"),
    ({"messages": MSG, "model": 7}, 400, "model"),
    ({"messages": [{"role": "user", "content": "a" * 300}]}, 400, "messages"),   # over the 256 context
]


@pytest.mark.parametrize("body,status,param", INVALID)
def test_invalid_chat_requests(shared_fake_server, body, status, param):
    r = httpx.post(shared_fake_server.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


INVALID_COMPLETIONS = [
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [10 ** 6]}, 400, "prompt"),
    ({"prompt": ["a", 5]}, 400, "prompt"),
    ({"prompt": [[1], "b"]}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": "abc", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt": "abc", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "abc", "best_of": 1, "n": 2}, 400, "best_of"),
    ({"prompt": "abc", "best_of": 3, "stream": True}, 400, "best_of"),
    ({"prompt": "abc", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "abc", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "abc", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "abc", "max_tokens": 300}, 400, "max_tokens"),
]


@pytest.mark.parametrize("body,status,param", INVALID_COMPLETIONS)
def test_invalid_completion_requests(shared_fake_server, body, status, param):
    r = httpx.post(shared_fake_server.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


RAW_INVALID = [
    (b'{"messages": [', "application/json", 400, "invalid_json"),
    (b'{"messages": NaN}', "application/json", 400, "invalid_json"),
    (b'{"messages": [], "temperature": Infinity}', "application/json", 400, "invalid_json"),
    (b'{"temperature": 1e999, "messages": []}', "application/json", 400, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "application/json", 400, "invalid_encoding"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "application/json", 400, "invalid_encoding"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "invalid_json"),
    (b"[1, 2]", "application/json", 400, "invalid_json"),
    (b"", "application/json", 400, "invalid_json"),
    (b"messages=hi", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    (b'{"messages": []}', "text/plain", 415, "unsupported_media_type"),
    (b'{"messages": []}', "application/json; charset=latin-1", 415, "unsupported_media_type"),
]


@pytest.mark.parametrize("raw,ctype,status,code", RAW_INVALID)
def test_malformed_bodies(shared_fake_server, raw, ctype, status, code):
    r = httpx.post(shared_fake_server.url + "/v1/chat/completions", content=raw,
                   headers={"content-type": ctype}, timeout=10)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_body_limit_declared_and_streamed(shared_fake_server):
    url = shared_fake_server.url + "/v1/chat/completions"
    big = json.dumps({"messages": [{"role": "user", "content": BIG}]}).encode()
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                       # chunked transfer: no Content-Length to check up front
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413


def test_unknown_route_and_method(shared_fake_server):
    r = httpx.get(shared_fake_server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(shared_fake_server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_unexpected_exception_is_a_json_error_not_a_traceback():
    from starlette.routing import Route

    async def boom(request):
        raise RuntimeError("secret internals")
    srv = start_fake_server()
    try:
        srv.state  # noqa: B018
        from chatserve.server.app import build_app
        app = build_app(srv.state, extra_routes=[Route("/boom", boom)])
        from starlette.testclient import TestClient
        with TestClient(app, raise_server_exceptions=False) as tc:
            r = tc.get("/boom")
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "secret" not in r.text
    finally:
        srv.stop()


# ---- admission, auth, isolation, rate limits ---------------------------------------------------
def test_queue_full_is_503_with_retry_after():
    srv = start_fake_server(delay=0.05, max_waiting=1, max_running=1)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                body = {"messages": MSG, "max_tokens": 20, "ignore_eos": True}
                rs = await asyncio.gather(*[c.post("/v1/chat/completions", json=body) for _ in range(6)])
                return rs
        rs = asyncio.run(run())
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 503 in codes
        r503 = next(r for r in rs if r.status_code == 503)
        assert int(r503.headers["retry-after"]) >= 1
        assert r503.json()["error"]["code"] == "server_overloaded"
    finally:
        srv.stop()


def test_api_keys_http_and_websocket():
    from websockets.sync.client import connect
    srv = start_fake_server(api_keys=("key-one", "key-two"))
    try:
        u = srv.url
        r = httpx.get(u + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(u + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        for k in ("key-one", "key-two"):
            assert httpx.get(u + "/v1/models", headers={"Authorization": f"Bearer {k}"}).status_code == 200
        assert httpx.post(u + "/tokenize", json={"prompt": "a"}).status_code == 401
        assert httpx.get(u + "/health").status_code == 200
        assert httpx.get(u + "/metrics").status_code == 200
        ws = u.replace("http", "ws") + "/v1/ws"
        with pytest.raises(Exception):
            with connect(ws) as c:
                c.recv(timeout=5)
        with connect(ws + "?api_key=key-two") as c:
            c.send(json.dumps({"id": "a", "messages": MSG, "max_tokens": 2}))
            assert json.loads(c.recv(timeout=5))["type"] == "chunk"
        with connect(ws, subprotocols=["chatserve", "chatserve.bearer.key-one"]) as c:
            assert c.subprotocol == "chatserve"
            c.send(json.dumps({"id": "a", "messages": MSG, "max_tokens": 2}))
            assert json.loads(c.recv(timeout=5))["type"] == "chunk"
    finally:
        srv.stop()


def test_prefix_cache_isolated_between_owners():
    srv = start_fake_server(api_keys=("alice", "bob"))
    try:
        def cached(key):
            r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"messages": [{"role": "user", "content": "shared long prompt"}],
                                 "max_tokens": 2}, timeout=10)
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached("alice") == 0
        assert cached("bob") == 0            # same prompt, other owner: no hit
        assert cached("alice") > 0           # same owner: hit
    finally:
        srv.stop()


def test_http_api_without_keys_is_one_owner_per_client_address(shared_fake_server):
    def cached(cookies=None):
        r = httpx.post(shared_fake_server.url + "/v1/chat/completions", cookies=cookies,
                       json={"messages": [{"role": "user", "content": "pooled prompt"}], "max_tokens": 1},
                       timeout=10)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached() == 0 and cached() > 0
    assert cached({"chatserve_uid": "A" * 32}) > 0


def test_identity_and_cache_salt():
    from starlette.requests import Request

    from chatserve.config import EngineConfig
    from chatserve.server.identity import api_owner_of, cache_salt, owner_of

    def conn(headers=(), state=None):
        return Request({"type": "http", "headers": list(headers), "state": state or {}})
    browser = conn([(b"cookie", b"chatserve_uid=" + b"A" * 32)])
    assert owner_of(browser) == "browser:" + "A" * 32 and api_owner_of(browser) == "client:unknown"
    keyed = conn(state={"chatserve_key_id": "0123456789abcdef"})
    assert owner_of(keyed) == api_owner_of(keyed) == "key:0123456789abcdef"
    assert owner_of(conn()) == "anonymous"

    class S:
        session_secret = b"s" * 32
        config = EngineConfig()
    assert cache_salt(S, "key:a") != cache_salt(S, "key:b")
    assert cache_salt(S, "key:a") == cache_salt(S, "key:a") and len(cache_salt(S, "key:a")) == 64


def test_rate_limit_429():
    srv = start_fake_server(rate_limit_rpm=2)
    try:
        away_from_a_minute_boundary()
        codes = [httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1},
                            timeout=10) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        assert int(codes[2].headers["retry-after"]) >= 1
        assert codes[2].json()["error"]["type"] == "rate_limit_error"
    finally:
        srv.stop()


# ---- disconnects ---------------------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_blocks():
    srv = start_fake_server(delay=0.01)
    try:
        s = raw_post(srv.url, "/v1/chat/completions",
                     {"messages": MSG, "max_tokens": 200, "ignore_eos": True, "stream": True})
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
        used = metric(httpx.get(srv.url + "/metrics").text, "chatserve:kv_cache_used_blocks")
        assert used > 0
        s.close()
        text = poll_metrics(srv.url, lambda t: metric(t, "chatserve:kv_cache_usage_perc") == 0)
        assert metric(text, "chatserve:kv_cache_usage_perc") == 0
        assert metric(text, "chatserve:num_requests_running") == 0
        assert 'finished_reason="abort"' in text
    finally:
        srv.stop()


def test_non_streaming_client_that_hangs_up_is_aborted():
    srv = start_fake_server(delay=0.01)
    try:
        s = raw_post(srv.url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 240, "ignore_eos": True})
        text = poll_metrics(srv.url, lambda t: metric(t, "chatserve:num_requests_running") > 0, interval=0.01)
        assert metric(text, "chatserve:num_requests_running") > 0
        s.close()
        text = poll_metrics(srv.url, lambda t: metric(t, "chatserve:num_requests_running") == 0)
        assert metric(text, "chatserve:kv_cache_used_blocks") == 0
        assert 'finished_reason="abort"' in text
    finally:
        srv.stop()
