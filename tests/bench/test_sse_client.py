"""The hand-written SSE parser and the stream rules, on scripted byte streams."""
from __future__ import annotations

import json

from chatserve.bench.sse_client import (CANCELLED, COMPLETED, ERRORED, INVALID, SSEParser, StreamChecker,
                                        StreamResult, is_error_body)


def _events(chunks: list[bytes]):
    p = SSEParser()
    out = []
    for c in chunks:
        out += p.feed(c)
    p.close()
    return out, p


def test_parser_line_ends_split_anywhere():
    raw = b'data: {"a": 1}\r\n\r\n: ping\n\ndata: x\ndata: y\r\revent: error\ndata:z\n\n'
    whole, p = _events([raw])
    assert [(e.event, e.data) for e in whole] == [(None, '{"a": 1}'), (None, "x\ny"), ("error", "z")]
    assert p.comments == 1
    bytewise, _ = _events([raw[i:i + 1] for i in range(len(raw))])
    assert [(e.event, e.data) for e in bytewise] == [(e.event, e.data) for e in whole]


def test_parser_utf8_split_inside_a_character():
    raw = 'data: {"c": "é✓"}\n\n'.encode()
    cut = raw.index("✓".encode()) + 1
    evs, _ = _events([raw[:cut], raw[cut:]])
    assert json.loads(evs[0].data) == {"c": "é✓"}


def test_parser_drops_unterminated_last_event():
    evs, _ = _events([b"data: [DONE]\n\ndata: tail"])
    assert [e.data for e in evs] == ["[DONE]"]


def _check(payloads: list[str], *, n: int = 1, cancelled: bool = False) -> StreamResult:
    res = StreamResult(status=200, cancelled=cancelled)
    ch = StreamChecker(res, chat=True, expected_n=n)
    p = SSEParser()
    for i, data in enumerate(payloads):
        for ev in p.feed(f"data: {data}\n\n".encode()):
            ch.feed(ev, 0.01 * i)
    res.outcome = ch.verdict()
    return res


def _c(idx=0, role=False, content=None, finish=None):
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return json.dumps({"choices": [{"index": idx, "delta": delta, "finish_reason": finish}]})


def test_good_stream_and_timing():
    r = _check([_c(role=True), _c(content="a"), _c(content="b"), _c(content="c", finish="stop"), "[DONE]"])
    assert r.outcome == COMPLETED and r.problems == []
    assert r.ttft_s == 0.01 and r.texts[0] == "abc" and r.output_tokens == 3
    assert [round(x, 3) for x in r.itls()] == [0.01, 0.01]


def test_rule_violations_each_named():
    cases = {
        "without [DONE]": [_c(role=True), _c(content="a", finish="stop")],
        "2 finish_reasons": [_c(role=True), _c(content="a", finish="stop"), _c(finish="length"), "[DONE]"],
        "no assistant role": [_c(content="a", finish="stop"), "[DONE]"],
        "after [DONE]": [_c(role=True), _c(content="a", finish="stop"), "[DONE]", _c(content="b")],
        "invalid JSON": [_c(role=True), "{oops", _c(content="a", finish="stop"), "[DONE]"],
        "0 finish_reasons": [_c(role=True), _c(content="a"), "[DONE]"],
    }
    for needle, payloads in cases.items():
        r = _check(payloads)
        assert r.outcome == INVALID, needle
        assert any(needle in p for p in r.problems), (needle, r.problems)


def test_parallel_choices_need_one_finish_each():
    good = [_c(0, role=True), _c(1, role=True), _c(0, content="a"), _c(1, content="b"),
            _c(0, finish="stop"), _c(1, finish="length"), "[DONE]"]
    assert _check(good, n=2).outcome == COMPLETED
    assert _check(good[:-2] + ["[DONE]"], n=2).outcome == INVALID
    assert "1 choices, expected 2" in _check([_c(role=True), _c(content="a", finish="stop"), "[DONE]"],
                                             n=2).problems[0]


def test_error_event_and_cancel_verdicts():
    err = json.dumps({"error": {"message": "boom", "type": "server_error"}})
    assert _check([_c(role=True), _c(content="a"), err, "[DONE]"]).outcome == ERRORED
    assert _check([_c(role=True), err, err, "[DONE]"]).outcome == INVALID
    assert _check([_c(role=True), _c(content="a")], cancelled=True).outcome == CANCELLED
    assert _check([_c(content="a")], cancelled=True).outcome == INVALID


def test_error_body_shape():
    assert is_error_body({"error": {"message": "m", "type": "t", "code": None}})
    assert not is_error_body({"error": "m"}) and not is_error_body({"detail": "x"}) and not is_error_body(None)
