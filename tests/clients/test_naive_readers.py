"""The SSE reading patterns hand-written clients use (most browser `fetch` code and some benchmark
clients), against chat, completion and session streams: split the byte stream on "\\n\\n" only, split
lines on "\\n" only, or strip each network read before buffering it (vLLM's `vllm bench serve`). Each must
get every event while the reply still streams, the usage chunk too, after a keep-alive, and when several
events arrive in one read."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

MSG = [{"role": "user", "content": "abc"}]


class Reader:
    """What every pattern shares: a text buffer fed one network read at a time, and the events so far.
    A subclass's `cut` takes the complete events off the buffer."""

    def __init__(self) -> None:
        self.buf = ""
        self.events: list[str] = []

    def feed(self, text: str) -> list[str]:
        got = self.cut(text)
        self.events += got
        return got

    def cut(self, text: str) -> list[str]:
        raise NotImplementedError


class BlankLineReader(Reader):
    """buffer += read; while "\\n\\n" in buffer: cut one event; its `data:` lines are the payload."""

    def cut(self, text: str) -> list[str]:
        self.buf += text
        got = []
        while "\n\n" in self.buf:
            block, self.buf = self.buf.split("\n\n", 1)
            data = [ln[5:].lstrip() for ln in block.split("\n") if ln.startswith("data:")]
            if data:
                got.append("\n".join(data))
        return got


class LineReader(Reader):
    """buffer += read; every complete line (split on "\\n") starting with "data: " is an event."""

    def cut(self, text: str) -> list[str]:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        return [ln[6:] for ln in lines if ln.startswith("data: ")]


class StripEachReadReader(Reader):
    """vLLM's benchmark client: each network read is stripped of surrounding whitespace and appended;
    events are cut at "\\n\\n", and what is left counts as an event when it is `data: ` followed by
    [DONE] or complete JSON. Lines starting with ":" are skipped. A comment that arrives alone would be
    glued to the next event here, so the server's keep-alive must be whitespace only."""

    def cut(self, text: str) -> list[str]:
        text = text.strip()
        if not text:
            return []
        self.buf += text
        msgs = []
        while "\n\n" in self.buf:
            msg, self.buf = self.buf.split("\n\n", 1)
            if msg.strip():
                msgs.append(msg.strip())
        if self.buf.startswith("data: "):
            rest = self.buf[6:].strip()
            try:
                if rest == "[DONE]" or json.loads(rest) is not None:
                    msgs.append(self.buf.strip())
                    self.buf = ""
            except ValueError:
                pass
        return [m[6:] for m in msgs if not m.startswith(":") and m.startswith("data: ")]


READERS = [BlankLineReader, LineReader, StripEachReadReader]


def has_keepalive(raw: str) -> bool:
    """An empty event: a blank line right after an event's own, or at the start of the body."""
    return raw.startswith("\n\n") or "\n\n\n\n" in raw


def stream_reads(url: str, path: str, body: dict, client: httpx.Client | None = None) -> list[str]:
    """The response body as the network delivered it: one string per read."""
    with (client or httpx).stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [b.decode() for b in r.iter_raw() if b]


def check_events(events: list[str], *, usage: bool) -> list[dict]:
    assert events and events[-1] == "[DONE]", events[-3:]
    objs = [json.loads(e) for e in events[:-1]]
    assert all("error" not in o for o in objs), objs
    if usage:
        assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] > 0
    return objs


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.__name__)
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 6, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 6, "stream": True,
                         "stream_options": {"include_usage": True}}),
], ids=["chat", "completions"])
def test_every_event_while_streaming_and_after_pings(slow_server, reader, path, body):
    reads = stream_reads(slow_server.url, path, body)
    raw = "".join(reads)
    assert "\r" not in raw, "bare LF framing"
    assert has_keepalive(raw), "the reply is slower than the keep-alive interval, so pings are interleaved"
    r = reader()
    got_at = []                                  # which read completed each event
    for i, chunk in enumerate(reads):
        got_at += [i] * len(r.feed(chunk))
    objs = check_events(r.events, usage=True)
    text = "".join((c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
                   for c in objs if c["choices"])
    assert text == "defghi"
    assert got_at[0] < got_at[-1], "the first event was parsed before the stream ended"
    first_ping = next(i for i, chunk in enumerate(reads) if has_keepalive("".join(reads[:i + 1])))
    assert any(i > first_ping for i in got_at[:-1]), "events still parsed after a keep-alive"


# Not StripEachReadReader: stripping a read that ends inside an event loses bytes whatever the server sends.
@pytest.mark.parametrize("reader", [BlankLineReader, LineReader], ids=lambda r: r.__name__)
def test_coalesced_reads_lose_nothing(shared_fake_server, reader):
    body = {"messages": MSG, "max_tokens": 8, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    raw = "".join(stream_reads(shared_fake_server.url, "/v1/chat/completions", body))
    expected = reader()
    expected.feed(raw)
    objs = check_events(expected.events, usage=True)
    assert sum(1 for o in objs for ch in o["choices"] if ch["finish_reason"]) == 2
    for size in (1, 7, 64, len(raw) // 3 + 1, len(raw)):      # several events (and splits) per read
        r = reader()
        for k in range(0, len(raw), size):
            r.feed(raw[k:k + size])
        assert r.events == expected.events, size


def test_first_chat_event_carries_the_first_token(slow_server):
    reads = stream_reads(slow_server.url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 3,
                                                                    "stream": True})
    r = BlankLineReader()
    for chunk in reads:
        r.feed(chunk)
    first = json.loads(r.events[0])["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": "d"}


def test_headers_and_a_keepalive_go_out_before_the_first_token(slow_server):
    """A long prefill must not look like a dead connection: the status line, headers and a keep-alive
    arrive before the first token does (the fake's first step takes 250 ms)."""
    for path, body in (("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "stream": True}),
                       ("/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream": True})):
        host, port = slow_server.url.rsplit("/", 1)[1].split(":")
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            seen = b""
            while b"data:" not in seen:
                part = s.recv(65536)
                assert part, seen
                seen += part
            assert seen.startswith(b"HTTP/1.1 200"), seen
            body = seen[seen.index(b"\r\n\r\n") + 4:seen.index(b"data:")]
            assert b"\r\n\n\n\r\n" in body, seen      # a chunk of the chunked body holding just "\n\n"


def test_session_stream_is_lf_framed(shared_fake_server):
    url = shared_fake_server.url
    with httpx.Client() as c:                  # the identity cookie makes the session ours
        s = c.post(url + "/v1/sessions", json={"title": "t"}, timeout=10)
        assert s.status_code == 201, s.text
        reads = stream_reads(url, f"/v1/sessions/{s.json()['id']}/messages", {"content": "abc", "max_tokens": 4},
                             client=c)
    raw = "".join(reads)
    assert "\r" not in raw
    for reader in READERS:
        r = reader()
        r.feed(raw)
        objs = check_events(r.events, usage=False)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in objs if c.get("choices"))
