"""WebSocket /v1/ws on a fake engine: interleaved requests, cancel, garbage frames, limits."""
from __future__ import annotations

import json
import time

import pytest
from server_support import metric, poll_metrics, start_fake_server
from websockets.sync.client import connect

MSG = [{"role": "user", "content": "abc"}]


@pytest.fixture
def slow_server():
    srv = start_fake_server(delay=0.01)
    yield srv
    srv.stop()


def frames_until(c, done_ids: set[str], timeout: float = 10) -> list[dict]:
    out, ended = [], set()
    deadline = time.time() + timeout
    while ended != done_ids and time.time() < deadline:
        f = json.loads(c.recv(timeout=timeout))
        out.append(f)
        if f.get("type") in ("done", "error", "cancelled") and f.get("id") in done_ids:
            ended.add(f["id"])
    assert ended == done_ids, out[-5:]
    return out


def test_two_interleaved_requests_and_a_cancel(slow_server):
    with connect(slow_server.url.replace("http", "ws") + "/v1/ws") as c:
        c.send(json.dumps({"id": "a", "type": "chat.completions", "messages": MSG, "max_tokens": 12}))
        c.send(json.dumps({"id": "b", "type": "completions", "prompt": "xyz", "max_tokens": 12}))
        c.send(json.dumps({"id": "c", "messages": MSG, "max_tokens": 240, "ignore_eos": True}))
        early = []
        while sum(f["id"] == "c" for f in early) < 3:      # c is streaming: cancel it
            early.append(json.loads(c.recv(timeout=10)))
        c.send(json.dumps({"type": "cancel", "id": "c"}))
        frames = early + frames_until(c, {"a", "b", "c"})
    ends = {f["id"]: f["type"] for f in frames if f["type"] != "chunk"}
    assert ends == {"a": "done", "b": "done", "c": "cancelled"}
    order = [f["id"] for f in frames if f["type"] == "chunk" and f["id"] in "ab"]
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")     # interleaved, not serial
    a = [f["chunk"] for f in frames if f["id"] == "a" and f["type"] == "chunk"]
    b = [f["chunk"] for f in frames if f["id"] == "b" and f["type"] == "chunk"]
    assert a[-1]["object"] == "chat.completion.chunk" and a[-1]["choices"] == [] and a[-1]["usage"]
    assert b[0]["object"] == "text_completion"
    text_b = "".join(ch["text"] for x in b for ch in x["choices"])
    assert text_b == "ABCDEFGHIJKL"
    text = poll_metrics(slow_server.url, lambda t: metric(t, "chatserve:kv_cache_used_blocks") == 0)
    assert metric(text, "chatserve:kv_cache_used_blocks") == 0


GARBAGE = [
    ("not json", 400, None),
    (json.dumps([1, 2]), 400, None),
    (json.dumps({"messages": MSG}), 400, None),                      # no id
    (json.dumps({"id": 5, "messages": MSG}), 400, None),
    (json.dumps({"id": "x" * 200, "messages": MSG}), 400, None),
    (json.dumps({"id": "q", "type": "nonsense"}), 400, "q"),
    (json.dumps({"id": "q", "messages": []}), 400, "q"),
    (json.dumps({"id": "q", "messages": MSG, "n": 99}), 400, "q"),
    ('{"id": "q", "messages": NaN}', 400, "q"),
    ('{"id": "q", "messages": [{"role": "user", "content": "\\udc00"}]}', 400, "q"),
]


@pytest.mark.parametrize("frame,status,cid", GARBAGE)
def test_garbage_frames_get_errors_and_the_socket_survives(shared_fake_server, frame, status, cid):
    with connect(shared_fake_server.url.replace("http", "ws") + "/v1/ws") as c:
        c.send(frame)
        f = json.loads(c.recv(timeout=5))
        assert f["type"] == "error" and f["status"] == status and f["id"] == cid
        assert set(f["error"]) == {"message", "type", "param", "code"}
        c.send(b"\x00\xff binary garbage")
        f = json.loads(c.recv(timeout=5))
        assert f["type"] == "error"
        c.send(json.dumps({"id": "ok", "messages": MSG, "max_tokens": 2}))
        frames = frames_until(c, {"ok"})
        assert frames[-1]["type"] == "done"


def test_duplicate_ids_and_cancel_of_unknown_id(slow_server):
    with connect(slow_server.url.replace("http", "ws") + "/v1/ws") as c:
        c.send(json.dumps({"type": "cancel", "id": "ghost"}))          # ignored
        c.send(json.dumps({"id": "d", "messages": MSG, "max_tokens": 50, "ignore_eos": True}))
        c.send(json.dumps({"id": "d", "messages": MSG, "max_tokens": 5}))
        frames = frames_until(c, {"d"})
    errs = [f for f in frames if f["type"] == "error"]
    assert len(errs) == 1 and "already in use" in errs[0]["error"]["message"] and errs[0]["id"] is None
    assert frames[-1] == {"id": "d", "type": "done"}


def test_socket_close_aborts_its_requests(slow_server):
    with connect(slow_server.url.replace("http", "ws") + "/v1/ws") as c:
        for i in range(3):
            c.send(json.dumps({"id": str(i), "messages": MSG, "max_tokens": 240, "ignore_eos": True}))
        for _ in range(6):
            c.recv(timeout=10)
    text = poll_metrics(slow_server.url, lambda t: metric(t, "chatserve:num_requests_running") == 0)
    assert metric(text, "chatserve:num_requests_running") == 0
    assert metric(text, "chatserve:kv_cache_used_blocks") == 0
