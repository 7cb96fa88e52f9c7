"""`chatserve bench serve` against the fake OpenAI server: workloads, metrics, JSON, plot."""
from __future__ import annotations

import json

import pytest

from chatserve.bench import serve
from chatserve.bench.workloads import PromptSource, multi_turn_jobs, parse_range, shared_prefix_jobs


def _run(capsys, fake, *args: str) -> dict:
    rc = serve.main(["--url", fake.url, "--json", "--no-progress", *args])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    return out


def test_random_workload_metrics(capsys, fake):
    r = _run(capsys, fake, "--num-prompts", "12", "--input-len", "8:24", "--output-len", "5",
             "--concurrency", "4", "--seed", "3", "--slo-ttft", "10000", "--slo-tpot", "10000")
    assert r["completed"] == r["num_requests"] == 12 and r["failed"] == 0
    assert r["model"] == "fake-model" and r["output_tokens"] == 60
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], key
    assert r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert r["output_token_throughput"] == pytest.approx(60 / r["duration_s"])
    assert r["goodput"] == pytest.approx(r["request_throughput"])
    bodies = fake.state.bodies
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    lens = [len(b["messages"][-1]["content"].split()) for b in bodies]
    assert min(lens) >= 8 and max(lens) <= 24


def test_tokens_are_counted_as_they_arrive_beside_the_servers_usage(capsys, fake):
    r = _run(capsys, fake, "--num-prompts", "3", "--input-len", "5", "--output-len", "4")
    assert r["output_tokens"] == r["output_chunks"] == r["usage_completion_tokens"] == 12
    assert r["usage_mismatches"] == 0 and r["usage_reported"] == "3/3"
    fake.reset()
    fake.state.behavior = "usage_half"                   # the server claims 2 tokens for 4 chunks
    r = _run(capsys, fake, "--num-prompts", "3", "--input-len", "5", "--output-len", "4")
    assert r["output_tokens"] == r["output_chunks"] == 12 and r["usage_completion_tokens"] == 6
    assert r["usage_mismatches"] == 3 and "usage 2, chunks 4" in r["usage_mismatch_examples"][0]
    assert "MISMATCH in 3 requests" in serve.format_report(r)


def test_received_text_is_re_encoded_with_a_tokenizer():
    """With a tokenizer, output tokens are the received text re-encoded; usage far from it is flagged."""
    from chatserve.bench.sse_client import COMPLETED, StreamResult
    from chatserve.bench.workloads import Job, Turn

    class Words:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    job = Job([Turn("hi", 8, 1)], tag="j")
    res = StreamResult(status=200, outcome=COMPLETED, texts={0: " one two three four five six"},
                       token_times={0: [0.1, 0.2, 0.3]}, usage={"completion_tokens": 6})
    rec = serve._record(job, 0, res, 0.0, Words())
    assert (rec.output_tokens, rec.chunks, rec.retokenized, rec.usage_tokens) == (6, 3, 6, 6)
    assert not rec.usage_mismatch()
    res.usage = {"completion_tokens": 20}                 # far more than the text holds
    assert serve._record(job, 0, res, 0.0, Words()).usage_mismatch()
    assert serve._record(job, 0, res, 0.0).usage_mismatch() is False   # chunks alone cannot tell


def test_multi_turn_history_and_prefix_hits(capsys, fake):
    r = _run(capsys, fake, "--workload", "multi-turn", "--conversations", "2", "--turns", "3",
             "--turn-len", "20", "--output-len", "6", "--ignore-eos")
    assert r["completed"] == 6
    # each later prompt carries the whole history, with the replies actually received
    by_len = sorted(fake.state.bodies, key=lambda b: len(b["messages"]))
    assert [len(b["messages"]) for b in by_len] == [1, 1, 3, 3, 5, 5]
    assert by_len[-1]["messages"][1]["role"] == "assistant"
    assert by_len[-1]["messages"][1]["content"].split() == [f"w{t}" for t in range(6)]
    assert all(b["ignore_eos"] is True for b in fake.state.bodies)
    assert 0.3 < r["prefix_cache_hit_rate"] < 1.0
    assert r["usage_cached_fraction_turn2plus"] > 0.5


def test_shared_prefix_resets_cache_and_hits(capsys, fake):
    r = _run(capsys, fake, "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "4",
             "--system-len", "64", "--question-len", "8", "--output-len", "3", "--reset-prefix-cache",
             "--warmup", "2", "--concurrency", "1")
    assert fake.state.resets == 1 and r["prefix_cache_reset"] is True
    assert r["completed"] == 8 and len(fake.state.bodies) == 10  # + 2 warm-up requests
    # 6 of the 8 prompts find their group's 64-token system prompt (+ role word) cached
    assert r["prefix_cache_hit_rate"] == pytest.approx(6 * 64 / sum(
        len((" ".join(m["role"] + " " + m["content"] for m in b["messages"])).split())
        for b in fake.state.bodies[2:])), r


def test_parallel_n_samples(capsys, fake):
    r = _run(capsys, fake, "--workload", "parallel", "--num-prompts", "3", "--n", "3",
             "--input-len", "10", "--output-len", "4")
    assert r["completed"] == 3 and r["output_tokens"] == 3 * 3 * 4
    assert all(b["n"] == 3 for b in fake.state.bodies)


def test_poisson_rate_and_no_metrics_server(capsys, fake):
    fake.state.metrics = False
    fake.state.has_reset = False
    r = _run(capsys, fake, "--num-prompts", "6", "--input-len", "4", "--output-len", "2",
             "--request-rate", "200", "--reset-prefix-cache", "--model", "fake-model")
    assert r["completed"] == 6 and r["request_rate"] == 200
    assert r["prefix_cache_hit_rate"] is None and r["prefix_cache_reset"] is False


def test_concurrency_sweep_plot_and_out_file(capsys, fake, tmp_path):
    png, out = tmp_path / "p.png", tmp_path / "r.json"
    r = _run(capsys, fake, "--num-prompts", "4", "--input-len", "4", "--output-len", "3",
             "--concurrency", "1,2,4", "--plot", str(png), "--out", str(out))
    assert [x["concurrency"] for x in r["runs"]] == [1, 2, 4]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text()) == r


def test_completions_endpoint_and_failures_reported(capsys, fake):
    r = _run(capsys, fake, "--endpoint", "completions", "--num-prompts", "2", "--input-len", "5",
             "--output-len", "2")
    assert r["completed"] == 2 and isinstance(fake.state.bodies[0]["prompt"], str)
    fake.reset()
    r = _run(capsys, fake, "--no-stream-usage", "--num-prompts", "2", "--input-len", "5", "--output-len", "3")
    assert "stream_options" not in fake.state.bodies[0] and r["output_tokens"] == 6  # counted per chunk
    assert r["usage_cached_fraction"] is None
    fake.state.behavior = "two_finish"
    rc = serve.main(["--url", fake.url, "--json", "--no-progress", "--num-prompts", "2",
                     "--input-len", "4", "--output-len", "2"])
    bad = json.loads(capsys.readouterr().out)
    assert rc == 3 and bad["failed"] == 2 and "2 finish_reasons" in bad["errors"][0]


def test_interference_workload_splits_the_streams_itls_at_the_long_prompt(capsys, fake):
    r = _run(capsys, fake, "--workload", "interference", "--streams", "3", "--input-len", "8",
             "--output-len", "100", "--long-len", "50", "--long-output-len", "4", "--long-delay", "0.05")
    assert r["completed"] == r["num_requests"] == 4
    lens = sorted(len(b["messages"][-1]["content"].split()) for b in fake.state.bodies)
    assert lens == [8, 8, 8, 50]
    it = r["interference"]
    assert it["long_ttft_ms"] > 0
    assert it["itl_outside_ms"]["p99"] > 0 and it["itl_during_ms"]["p50"] is not None
    assert it["itl_p99_ratio"] > 0


def test_interference_says_when_the_streams_end_before_the_long_prefill():
    """Streams that finish before the long prompt's first token measure none (or part) of its prefill: the
    report says so instead of printing 0.0 ms (seen on a fast box with 128-token streams)."""
    from chatserve.bench.serve_report import Record, format_report, interference_summary, summarize

    def rec(job: str, start: float, times: list[float], ttft: float | None = None) -> Record:
        return Record(job, 0, True, ttft, None, None, [], len(times), 8, None, start_s=start, token_times=times)

    long = rec("long", 1.0, [3.0], ttft=2.0)                                  # prefilled from 1.0 s to 3.0 s
    ended = interference_summary([rec("stream0", 0.0, [0.1, 0.2, 0.3]), long])
    assert ended["itl_during_ms"]["p50"] is None and not ended["streams_span_prefill"]
    partly = interference_summary([rec("stream0", 0.0, [0.5, 1.5, 2.0]), rec("stream1", 0.0, [0.5, 2.5, 3.5]),
                                   long])
    assert partly["itl_during_ms"]["p50"] is not None and not partly["streams_span_prefill"]
    whole = interference_summary([rec("stream0", 0.0, [0.5, 2.5, 3.5]), long])
    assert whole["streams_span_prefill"]
    base = {**summarize([long], 4.0), "workload": "interference", "model": "m", "concurrency": None,
            "request_rate": None}
    text = format_report({**base, "interference": ended})
    assert "none arrived during its prefill" in text and "0.0/0.0" not in text
    assert "some streams ended before its first token" in format_report({**base, "interference": partly})
    assert "raise --output-len" not in format_report({**base, "interference": whole})


def test_interference_jobs_delay_only_the_long_prompt():
    import random

    from chatserve.bench.workloads import interference_jobs

    jobs = interference_jobs(PromptSource(random.Random(0)), 4, "16", "100", 4000, 64, 1.5)
    assert [j.tag for j in jobs] == ["stream0", "stream1", "stream2", "stream3", "long"]
    assert [j.delay_s for j in jobs] == [0.0] * 4 + [1.5]
    assert jobs[-1].turns[0].max_tokens == 64 and jobs[-1].turns[0].approx_prompt_tokens == 4000


def test_workload_shapes():
    import random

    src = PromptSource(random.Random(0))
    jobs = shared_prefix_jobs(src, 3, 5, 40, "10", "8")
    assert len(jobs) == 15 and len({j.system for j in jobs}) == 3
    conv = multi_turn_jobs(src, 2, 4, "10", "5", system_len=20)
    assert [t.approx_prompt_tokens for t in conv[0].turns] == [30, 45, 60, 75]
    assert parse_range("7") == (7, 7) and parse_range("3:9") == (3, 9)
    with pytest.raises(ValueError):
        parse_range("9:3")


class _WordTok:
    """A stand-in tokenizer: one id per word."""
    vocab: dict[str, int] = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, len(self.vocab) + 5) for w in text.split()]

    def decode(self, ids):
        inv = {v: k for k, v in self.vocab.items()}
        return " ".join(inv[i] for i in ids)


def test_token_id_prompts_are_exact(monkeypatch, capsys, fake):
    monkeypatch.setattr(serve.workloads, "load_tokenizer", lambda spec: _WordTok())
    r = _run(capsys, fake, "--tokenizer", "x", "--workload", "multi-turn", "--conversations", "1",
             "--turns", "2", "--turn-len", "17", "--output-len", "3")
    assert r["endpoint"] == "completions" and r["completed"] == 2
    p0, p1 = (b["prompt"] for b in fake.state.bodies)
    assert len(p0) == 17 and all(isinstance(x, int) for x in p0)
    assert p1[:17] == p0 and len(p1) == 17 + 3 + 17  # history + reply re-encoded + new turn


def test_structured_workload_pairs_each_reply_with_an_unconstrained_twin(capsys, fake):
    r = _run(capsys, fake, "--workload", "structured", "--num-prompts", "4", "--output-len", "5:9",
             "--concurrency", "2", "--rounds", "2")
    constrained = [b for b in fake.state.bodies if "response_format" in b]
    twins = [b for b in fake.state.bodies if "response_format" not in b]
    assert len(constrained) == len(twins) == 8
    rf = constrained[0]["response_format"]["json_schema"]
    assert rf["strict"] is True and rf["schema"]["properties"]["author"]["type"] == "object"
    assert all(b["ignore_eos"] for b in twins) and not any(b.get("ignore_eos") for b in constrained)
    # each twin generates what its constrained request produced (the fake produces max_tokens)
    assert sorted(b["max_tokens"] for b in twins) == sorted(b["max_tokens"] for b in constrained)
    assert r["unconstrained"]["output_tokens"] == r["output_tokens"] > 0 and r["rounds"] == 2
    assert r["json_parsed"] == 0                 # the fake's words are not JSON
    assert r["tpot_ratio"]["p50"] > 0
    # the twins are the same prompts, each arm starting from a reset prefix cache
    def prompt(b): return json.dumps(b["messages"])
    assert sorted(map(prompt, twins)) == sorted(map(prompt, constrained))
    assert len(set(map(prompt, constrained))) == 8
    assert fake.state.resets == r["prefix_cache_resets"] == 4


def test_editing_workload_sends_a_text_with_typos_to_fix(capsys, fake):
    from chatserve.bench.workloads import EDIT_INSTRUCTION, WORDS

    r = _run(capsys, fake, "--workload", "editing", "--num-prompts", "6", "--input-len", "40",
             "--output-len", "5", "--seed", "2")
    assert r["completed"] == 6 and r["workload"] == "editing"
    texts = [b["messages"][-1]["content"] for b in fake.state.bodies]
    assert len(texts) == 6 and all(t.startswith(EDIT_INSTRUCTION) for t in texts)
    words = [w for t in texts for w in t[len(EDIT_INSTRUCTION):].split()]
    assert len(words) == 240
    typos = [w for w in words if w not in WORDS]
    assert 0 < len(typos) < len(words) * 0.3        # about 15 % misspelt, the rest verbatim
