"""Bad input: schemathesis against /openapi.json on a live app (fake engine), and a table of hostile
HTTP bodies and WebSocket frames with their exact answers (the same table is in docs/reliability.md)."""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from websockets.sync.client import connect

from hardening_support import start_fake_server

M = [{"role": "user", "content": "hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def bad_input_server():
    srv = start_fake_server(delay=0.0)
    yield srv
    srv.stop()


def _j(o) -> bytes:
    return json.dumps(o).encode()


def _assert_openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ---- schemathesis -------------------------------------------------------------------------------
def _operations(url: str):
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    return [r.ok() for r in schemathesis.openapi.from_dict(spec).get_all_operations()]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_no_5xx_and_every_4xx_is_an_openai_error(bad_input_server, mode):
    """Every operation of the published /openapi.json, fuzzed with valid (positive) and schema-breaking
    (negative) requests: never a 5xx, every 4xx is the OpenAI error object, 503 carries Retry-After."""
    url = bad_input_server.url
    seen: dict[int, int] = {}
    sent: set[str] = set()                # a case hypothesis draws again is not sent again (~25 % of negative)
    for op in _operations(url):
        strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @given(case=strategy)
        @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            key = json.dumps([op.label, case.path_parameters, case.query, case.headers, case.body],
                             sort_keys=True, default=repr)
            if key in sent:
                return
            sent.add(key)
            r = case.call(base_url=url, timeout=30)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (op.label, case.body, r.status_code, r.text[:300])
            if r.status_code >= 400:
                body = r.json()
                assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, (op.label, r.text[:300])
                if r.status_code == 503:
                    assert "retry-after" in r.headers
        try:
            check()
        except Unsatisfiable:
            assert mode == "negative"      # an operation with no parameters has nothing to break
    print(f"schemathesis {mode}: status counts {dict(sorted(seen.items()))}")
    assert seen.get(400 if mode == "negative" else 200, 0) > 0


# ---- the hostile-input table --------------------------------------------------------------------
def _chunked_4mib():
    yield b'{"messages":[{"role":"user","content":"'
    for _ in range(40):
        yield b"a" * 100_000
    yield b'"}]}'


CHAT = "/v1/chat/completions"
HOSTILE = [
    # name, path, body, content type, status, code, param
    ("body over 2 MiB (declared)", CHAT, _j({"messages": [{"role": "user", "content": "a" * (3 << 20)}]}),
     "application/json", 413, "request_too_large", None),
    ("body over 2 MiB (chunked, undeclared)", CHAT, _chunked_4mib, "application/json", 413,
     "request_too_large", None),
    ("JSON nested 100,000 deep", CHAT, b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "application/json", 400, "invalid_json", None),
    ("JSON nested 100 deep", CHAT, b'{"messages":' + b"[" * 100 + b"]" * 100 + b"}", "application/json",
     400, "invalid_json", None),
    ("lone surrogate \\ud800", CHAT, b'{"messages":[{"role":"user","content":"\\ud800"}]}',
     "application/json", 400, "invalid_encoding", None),
    ("invalid UTF-8 bytes ff fe", CHAT, b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',
     "application/json", 400, "invalid_encoding", None),
    ("n = 1,000,000", CHAT, _j({"messages": M, "n": 10**6}), "application/json", 400, "invalid_value", "n"),
    ("max_tokens = 10^12", CHAT, _j({"messages": M, "max_tokens": 10**12}), "application/json", 400,
     "context_length_exceeded", "max_tokens"),
    ("max_tokens with 5,000 digits", CHAT, b'{"messages":[],"max_tokens":1' + b"0" * 5000 + b"}",
     "application/json", 400, "invalid_json", None),
    ("logit_bias with 100,000 entries", CHAT, _j({"messages": M, "logit_bias": {str(i): 1 for i in range(100_000)}}),
     "application/json", 400, "invalid_value", "logit_bias"),
    ("logit_bias value 1e308", CHAT, _j({"messages": M, "logit_bias": {"1": 1e308}}), "application/json", 400,
     "invalid_value", "logit_bias"),
    ("logit_bias token outside the vocabulary", CHAT, _j({"messages": M, "logit_bias": {"99999999": 1}}),
     "application/json", 400, "invalid_value", "logit_bias"),
    ("messages is a string", CHAT, _j({"messages": "hello"}), "application/json", 400, "invalid_type", "messages"),
    ("temperature is a string", CHAT, _j({"messages": M, "temperature": "hot"}), "application/json", 400,
     "invalid_type", "temperature"),
    ("max_tokens = 1.5", CHAT, _j({"messages": M, "max_tokens": 1.5}), "application/json", 400, "invalid_type",
     "max_tokens"),
    ("n = true", CHAT, _j({"messages": M, "n": True}), "application/json", 400, "invalid_type", "n"),
    ("stream = \"yes\"", CHAT, _j({"messages": M, "stream": "yes"}), "application/json", 400, "invalid_type",
     "stream"),
    ("content = null", CHAT, _j({"messages": [{"role": "user", "content": None}]}), "application/json", 400,
     "invalid_type", "messages[0].content"),
    ("unknown role", CHAT, _j({"messages": [{"role": "god", "content": "x"}]}), "application/json", 400,
     "invalid_value", "messages[0].role"),
    ("100 stop strings", CHAT, _j({"messages": M, "stop": ["x"] * 100}), "application/json", 400,
     "invalid_value", "stop"),
    ("NaN", CHAT, b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', "application/json", 400,
     "invalid_json", None),
    ("1e999 (overflows to infinity)", CHAT, b'{"messages":[{"role":"user","content":"hi"}],"temperature":1e999}',
     "application/json", 400, "invalid_json", None),
    ("empty body", CHAT, b"", "application/json", 400, "invalid_json", None),
    ("a JSON array", CHAT, b"[1,2]", "application/json", 400, "invalid_json", None),
    ("malformed JSON", CHAT, b"{nope", "application/json", 400, "invalid_json", None),
    ("text/plain content type", CHAT, _j({"messages": M}), "text/plain", 415, "unsupported_media_type", None),
    ("prompt token id outside the vocabulary", "/v1/completions", _j({"prompt": [99_999_999]}),
     "application/json", 400, "invalid_value", "prompt"),
    ("unknown model", CHAT, _j({"messages": M, "model": "gpt-9"}), "application/json", 404, "model_not_found",
     "model"),
]


@pytest.mark.parametrize("name,path,body,ctype,status,code,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_http_inputs(bad_input_server, name, path, body, ctype, status, code, param):
    content = body() if callable(body) else body
    r = httpx.post(bad_input_server.url + path, content=content, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == status, r.text[:300]
    err = _assert_openai_error(r)
    assert err["code"] == code and err["param"] == param
    # the server is still fine afterwards
    ok = httpx.post(bad_input_server.url + CHAT, json={"messages": M, "max_tokens": 1}, timeout=10)
    assert ok.status_code == 200


WS_HOSTILE = [
    # name, frame, status of the error frame, the id it is tagged with
    ("text that is not JSON", "not json", 400, None),
    ("binary garbage", b"\x00\xff\xfe binary", 400, None),
    ("invalid UTF-8 in a binary frame", b'{"id":"q","messages":[{"role":"user","content":"\xff"}]}', 400, None),
    ("a JSON array", "[1, 2]", 400, None),
    ("no id", json.dumps({"messages": M}), 400, None),
    ("id of 200 characters", json.dumps({"id": "x" * 200, "messages": M}), 400, None),
    ("unknown type", json.dumps({"id": "q", "type": "rm -rf"}), 400, "q"),
    ("n = 99", json.dumps({"id": "q", "messages": M, "n": 99}), 400, "q"),
    ("lone surrogate", '{"id": "q", "messages": [{"role": "user", "content": "\\udc00"}]}', 400, "q"),
    ("deep nesting", '{"id": "q", "messages": ' + "[" * 5000 + "]" * 5000 + "}", 400, None),
    ("frame over max_body_bytes (64 KiB here)", json.dumps({"id": "big", "messages": [
        {"role": "user", "content": "a" * 65_600}]}), 413, "big"),
]


@pytest.fixture(scope="module")
def small_body_server():
    srv = start_fake_server(delay=0.0, max_body_bytes=65_536)   # ws_max_size = max_body_bytes + 1 KiB
    yield srv
    srv.stop()


@pytest.mark.parametrize("name,frame,status,cid", WS_HOSTILE, ids=[w[0] for w in WS_HOSTILE])
def test_hostile_websocket_frames(small_body_server, name, frame, status, cid):
    with connect(small_body_server.url.replace("http", "ws") + "/v1/ws", max_size=None) as c:
        c.send(frame)
        f = json.loads(c.recv(timeout=5))
        assert f["type"] == "error" and f["status"] == status and f["id"] == cid, f
        assert set(f["error"]) == ERROR_KEYS
        c.send(json.dumps({"id": "ok", "messages": M, "max_tokens": 2}))     # the socket survives
        while True:
            f = json.loads(c.recv(timeout=5))
            if f["id"] == "ok" and f["type"] != "chunk":
                break
        assert f["type"] == "done"


def test_websocket_frame_over_the_transport_limit_closes_with_1009(small_body_server):
    with connect(small_body_server.url.replace("http", "ws") + "/v1/ws", max_size=None) as c:
        c.send("x" * 200_000)
        with pytest.raises(Exception) as e:
            c.recv(timeout=5)
    assert "1009" in str(e.value)
