"""Streaming OpenAI-API client shared by `bench serve` and `bench load`: hand-parsed SSE, per-chunk
timing, and a verdict on whether each stream is well-formed.

Not a general OpenAI client: it never retries, and it records only what the benchmarks measure.
"""
from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Outcomes of one request, as the load tool counts them.
COMPLETED = "completed"      # 200, valid stream, one finish_reason per choice, [DONE] last
ERRORED = "errored"          # 200, valid stream ended by exactly one error event
CANCELLED = "cancelled"      # we closed the connection mid-stream; what arrived was valid
REJECTED = "rejected"        # 4xx / 503 with an OpenAI error body
SERVER_ERROR = "server_error"  # 5xx (other than a proper 503), or a non-200 without an error body
INVALID = "invalid"          # 200 but the stream broke a rule (or the connection dropped): "lost"
TRANSPORT = "transport"      # no HTTP answer at all (connection refused, timeout before headers)


@dataclass
class SSEEvent:
    event: str | None
    data: str


class SSEParser:
    """Incremental text/event-stream parser (WHATWG rules): `feed(bytes)` returns complete events.

    Handles LF, CRLF and CR line ends split across chunks, comment lines (keep-alive pings),
    multi-line `data:` fields, and one optional space after the colon.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event: str | None = None
        self.comments = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += self._decoder.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[SSEEvent]:
        """End of stream: a trailing event without its blank line is dropped (as browsers do)."""
        self._buf += self._decoder.decode(b"", final=True)
        self._drain(final=True)
        return []

    def _drain(self, final: bool) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        buf, pos = self._buf, 0
        while True:
            i = _line_end(buf, pos, final)
            if i is None:
                break
            line = buf[pos:i]
            pos = i + 2 if buf.startswith("\r\n", i) else i + 1
            ev = self._line(line)
            if ev is not None:
                out.append(ev)
        self._buf = buf[pos:]
        return out

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data and self._event is None:
                return None
            ev = SSEEvent(self._event, "\n".join(self._data))
            self._data, self._event = [], None
            return ev
        if line.startswith(":"):
            self.comments += 1
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # id:, retry: and unknown fields are ignored


def _line_end(buf: str, pos: int, final: bool) -> int | None:
    """Index of the first line terminator at or after pos (str.find, not a loop over characters);
    a CR at the very end waits for a possible LF."""
    lf = buf.find("\n", pos)
    cr = buf.find("\r", pos, lf if lf >= 0 else len(buf))
    if cr < 0:
        return lf if lf >= 0 else None
    if cr + 1 < len(buf) or final:
        return cr
    return None


@dataclass
class StreamResult:
    """Everything one streamed request produced. Times are seconds since the request was sent."""

    status: int | None = None
    outcome: str = TRANSPORT
    problems: list[str] = field(default_factory=list)
    headers_s: float | None = None          # time to the response headers
    ttft_s: float | None = None             # time to the first content of any choice
    e2e_s: float | None = None
    token_times: dict[int, list[float]] = field(default_factory=dict)  # choice -> content chunk times
    texts: dict[int, str] = field(default_factory=dict)
    finish_reasons: dict[int, list[str]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None      # the OpenAI error object (body or error event)
    retry_after: str | None = None
    transport_error: str | None = None
    cancelled: bool = False
    done: bool = False

    @property
    def content_chunks(self) -> int:
        return sum(len(t) for t in self.token_times.values())

    @property
    def output_tokens(self) -> int:
        """Tokens as they arrived: content chunks, all choices (the server's own count is usage_tokens)."""
        return self.content_chunks

    @property
    def usage_tokens(self) -> int | None:
        """The server's usage.completion_tokens, or None when it sent no usage."""
        v = (self.usage or {}).get("completion_tokens")
        return v if isinstance(v, int) else None

    def retokenized(self, tokenizer: Any) -> int:
        """The received text of every choice re-encoded by `tokenizer` (without special tokens)."""
        return sum(len(tokenizer.encode(t)) for t in self.texts.values())

    @property
    def prompt_tokens(self) -> int | None:
        v = (self.usage or {}).get("prompt_tokens")
        return v if isinstance(v, int) else None

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        v = details.get("cached_tokens") if isinstance(details, dict) else None
        return v if isinstance(v, int) else None

    def itls(self) -> list[float]:
        """Inter-token latencies (s) within each choice."""
        out: list[float] = []
        for times in self.token_times.values():
            out.extend(b - a for a, b in zip(times, times[1:]))
        return out

    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (tokens after the first), per choice averaged as vLLM does for n=1."""
        if self.ttft_s is None or self.e2e_s is None:
            return None
        n_choices = max(1, len(self.token_times))
        per_choice = self.output_tokens / n_choices
        if per_choice <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (per_choice - 1)


def is_error_body(obj: Any) -> bool:
    """The OpenAI error shape: {"error": {"message": str, "type": str, ...}}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    err = obj["error"]
    return isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


class StreamChecker:
    """Applies the stream rules to each event as it arrives and records timing and content."""

    def __init__(self, res: StreamResult, chat: bool, expected_n: int) -> None:
        self.res = res
        self.chat = chat
        self.expected_n = expected_n
        self.error_events = 0
        self.seen: set[int] = set()

    def feed(self, ev: SSEEvent, t: float) -> None:
        r = self.res
        if r.done:
            r.problems.append("event after [DONE]")
            return
        if ev.data == "[DONE]":
            r.done = True
            return
        try:
            obj = json.loads(ev.data)
        except ValueError:
            r.problems.append(f"invalid JSON in data: {ev.data[:60]!r}")
            return
        if not isinstance(obj, dict):
            r.problems.append("data is not a JSON object")
            return
        if "error" in obj:
            self.error_events += 1
            r.error = obj.get("error") if isinstance(obj.get("error"), dict) else {"message": str(obj)}
            if not is_error_body(obj):
                r.problems.append("error event without message/type")
            return
        if self.error_events:
            r.problems.append("chunk after an error event")
        if obj.get("usage"):
            r.usage = obj["usage"]
        for ch in obj.get("choices") or []:
            self._choice(ch, t)

    def _choice(self, ch: dict, t: float) -> None:
        r = self.res
        idx = ch.get("index", 0)
        if self.chat:
            delta = ch.get("delta") or {}
            if idx not in self.seen and delta.get("role") != "assistant":
                r.problems.append(f"choice {idx}: first chunk has no assistant role")
            text = delta.get("content") or delta.get("reasoning_content") or ""
        else:
            text = ch.get("text") or ""
        self.seen.add(idx)
        finish = ch.get("finish_reason")
        if r.finish_reasons.get(idx) and (text or finish):
            r.problems.append(f"choice {idx}: data after its finish_reason")
        if text:
            r.texts[idx] = r.texts.get(idx, "") + text
            r.token_times.setdefault(idx, []).append(t)
            if r.ttft_s is None:
                r.ttft_s = t
        if finish is not None:
            r.finish_reasons.setdefault(idx, []).append(finish)

    def verdict(self) -> str:
        """Final outcome; adds end-of-stream problems."""
        r = self.res
        if self.error_events > 1:
            r.problems.append(f"{self.error_events} error events")
        if r.cancelled:
            return INVALID if r.problems else CANCELLED
        if not r.done:
            r.problems.append("stream ended without [DONE]")
        if self.error_events == 0:
            if not self.seen:
                r.problems.append("no choices in the stream")
            elif self.expected_n and len(self.seen) != self.expected_n:
                r.problems.append(f"{len(self.seen)} choices, expected {self.expected_n}")
            for idx in sorted(self.seen):
                k = len(r.finish_reasons.get(idx, []))
                if k != 1:
                    r.problems.append(f"choice {idx}: {k} finish_reasons")
        if r.problems:
            return INVALID
        return ERRORED if self.error_events else COMPLETED


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    *,
    chat: bool = True,
    expected_n: int = 1,
    cancel_after_chunks: int | None = None,
    max_error_body: int = 65536,
) -> StreamResult:
    """POST `body` (which must have stream=true) and consume the SSE stream.

    cancel_after_chunks: close the connection once this many content chunks arrived (a client
    that goes away mid-stream); the server should abort the request.
    """
    res = StreamResult()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            res.status = resp.status_code
            res.headers_s = time.perf_counter() - t0
            res.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                raw = b""
                async for part in resp.aiter_bytes():
                    raw += part
                    if len(raw) > max_error_body:
                        break
                res.e2e_s = time.perf_counter() - t0
                _classify_refusal(res, raw)
                return res
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                res.problems.append(f"content-type {ctype!r}, not text/event-stream")
            parser = SSEParser()
            checker = StreamChecker(res, chat, expected_n)
            try:
                async for part in resp.aiter_bytes():
                    now = time.perf_counter() - t0
                    for ev in parser.feed(part):
                        checker.feed(ev, now)
                    if cancel_after_chunks is not None and res.content_chunks >= cancel_after_chunks \
                            and not res.done:
                        res.cancelled = True
                        break  # leaving the `async with` closes the connection
                parser.close()
            except httpx.HTTPError as e:  # connection dropped mid-stream
                res.transport_error = f"{type(e).__name__}: {e}"
                res.problems.append(f"stream broken: {type(e).__name__}")
            res.e2e_s = time.perf_counter() - t0
            res.outcome = checker.verdict()
            return res
    except httpx.HTTPError as e:
        res.transport_error = f"{type(e).__name__}: {e}"
        res.e2e_s = time.perf_counter() - t0
        if res.status == 200:  # broken while closing
            res.outcome = INVALID
        return res


def _classify_refusal(res: StreamResult, raw: bytes) -> None:
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    proper = is_error_body(obj)
    if proper:
        res.error = obj["error"]
    else:
        res.problems.append(f"HTTP {res.status} without an OpenAI error body: {raw[:80]!r}")
    status = res.status or 0
    if proper and (400 <= status < 500 or status == 503):
        res.outcome = REJECTED
    elif 400 <= status < 500:
        res.outcome = INVALID  # a 4xx we could not understand: counted as lost
    else:
        res.outcome = SERVER_ERROR


def make_client(base_url: str, *, api_key: str | None = None, connections: int = 100,
                timeout: float = 600.0) -> httpx.AsyncClient:
    """One pooled client for a whole run; `connections` should cover the concurrency."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=10.0, pool=None),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def first_model(client: httpx.AsyncClient) -> str:
    """The first id listed by GET /v1/models."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError("the server lists no models; pass --model")
    return str(data[0]["id"])
