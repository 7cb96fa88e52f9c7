"""`chatserve bench load` against the fake server: counts, cancellation, leaks, and each misbehaviour."""
from __future__ import annotations

import json

from chatserve.bench import load


def _run(capsys, fake, *args: str, expect_rc: int | None = 0) -> dict:
    rc = load.main(["--url", fake.url, "--json", "--duration", "5", "--idle-timeout", "3",
                    "--prompt-len", "4:30", *args])
    out = json.loads(capsys.readouterr().out)
    if expect_rc is not None:
        assert rc == expect_rc, out
    accepted = out["completed"] + out["cancelled"] + out["errored"] + out["lost"]
    assert out["accepted"] == accepted, out  # every accepted stream is accounted for
    return out


def test_healthy_server_with_cancellations(capsys, fake):
    # 30 ms a token: a stream cancelled after 1-4 chunks is still running when the cancel arrives, even when
    # a loaded box delays the client (at 2 ms the server could finish first and see no disconnect)
    fake.state.token_delay = 0.03
    r = _run(capsys, fake, "--concurrency", "8", "--cancel-fraction", "0.5", "--max-requests", "40",
             "--max-tokens", "8:16")
    assert r["requests_sent"] == r["accepted"] == 40
    assert r["lost"] == r["server_errors"] == r["rejected"] == 0
    assert 8 <= r["cancelled"] <= 32 and r["completed"] == 40 - r["cancelled"]
    assert r["leaked_blocks"] == 0 and r["ok"] is True
    assert 0 < r["ttft_p50"] <= r["ttft_p99"]
    assert fake.state.cancelled == r["cancelled"]  # the server saw each cancel as a disconnect


def test_duration_bounds_the_run(capsys, fake):
    fake.state.token_delay = 0.01
    rc = load.main(["--url", fake.url, "--json", "--duration", "0.5", "--concurrency", "2",
                    "--max-tokens", "5", "--cancel-fraction", "0"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["completed"] == r["requests_sent"] > 2
    # each request takes at least 5 tokens × 10 ms: 2 workers can start at most this many in 0.5 s
    assert r["requests_sent"] <= 2 * (0.5 / (5 * 0.01)) + 2


def test_leaked_blocks_detected(capsys, fake):
    fake.state.leak_on_cancel = True
    r = _run(capsys, fake, "--concurrency", "4", "--cancel-fraction", "1", "--max-requests", "6",
             "--max-tokens", "20", expect_rc=3)
    assert r["cancelled"] == 6 and r["leaked_blocks"] > 0 and r["ok"] is False


def test_unknown_leaks_are_unverified_not_a_pass(capsys, fake):
    fake.state.metrics = False                       # no /metrics: KV blocks in use cannot be read
    r = _run(capsys, fake, "--concurrency", "2", "--cancel-fraction", "0", "--max-requests", "4",
             "--max-tokens", "4", expect_rc=4)
    assert r["completed"] == 4 and r["leaked_blocks"] is None
    assert r["verdict"] == "unverified" and r["ok"] is False
    assert "verdict: UNVERIFIED" in load.format_report(r)


def test_overload_503_counted_as_rejected_with_latency(capsys, fake):
    fake.state.max_running = 1
    fake.state.token_delay = 0.005
    r = _run(capsys, fake, "--concurrency", "4", "--cancel-fraction", "0", "--max-requests", "30",
             "--max-tokens", "10", "--max-backoff", "0.01")
    assert r["rejected"] > 0 and r["rejected"] == r["overload_503_count"]
    assert r["rejected_without_retry_after"] == 0 and r["server_errors"] == 0
    assert r["completed"] == r["accepted"] and r["rejected"] + r["accepted"] == 30
    assert 0 < r["overload_503_latency_ms_p50"] <= r["overload_503_latency_ms"]


def test_misbehaving_streams_are_lost(capsys, fake):
    for behavior, problem in [("missing_done", "without [DONE]"), ("two_finish", "2 finish_reasons"),
                              ("no_role", "no assistant role"), ("bad_json", "invalid JSON"),
                              ("drop", "stream broken")]:
        fake.reset()
        fake.state.behavior = behavior
        r = _run(capsys, fake, "--concurrency", "2", "--cancel-fraction", "0", "--max-requests", "4",
                 "--max-tokens", "4", expect_rc=3)
        assert r["lost"] == r["accepted"] == 4 and r["completed"] == 0, behavior
        assert any(problem in p for p in r["problems"]), (behavior, r["problems"])


def test_error_event_is_a_proper_ending(capsys, fake):
    fake.state.behavior = "error_event"
    r = _run(capsys, fake, "--concurrency", "2", "--cancel-fraction", "0", "--max-requests", "4",
             "--max-tokens", "8")
    assert r["errored"] == 4 and r["lost"] == 0 and r["ok"] is True


def test_500_and_bare_503_are_server_errors(capsys, fake):
    fake.state.behavior = "http500"
    r = _run(capsys, fake, "--concurrency", "2", "--max-requests", "3", expect_rc=3)
    assert r["server_errors"] == 3 and r["accepted"] == 0 and r["rejected"] == 0
    fake.reset()
    fake.state.behavior, fake.state.max_running = "plain503", 0
    r = _run(capsys, fake, "--concurrency", "1", "--max-requests", "2", expect_rc=3)
    assert r["server_errors"] == 2 and r["rejected"] == 0
    assert any("without an OpenAI error body" in p for p in r["problems"])
