"""The metrics a vLLM dashboard expects (issue 23), read with prometheus_client's own parser, and
/metrics served with prometheus_client's content type; the bench tools read it the same way."""
from __future__ import annotations

import httpx
import pytest
from hardening_support import start_fake_server
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from chatserve.bench import server_metrics

pytestmark = pytest.mark.timeout(60)


def test_vllm_dashboard_metrics_and_content_type():
    srv = start_fake_server()
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "n": 2})
        assert r.status_code == 200
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 200
        assert httpx.get(srv.url + "/no-such-route", timeout=10).status_code == 404
        m = httpx.get(srv.url + "/metrics", timeout=10)
        assert m.headers["content-type"] == CONTENT_TYPE_LATEST
        fams = {f.name: f for f in text_string_to_metric_families(m.text)}
    finally:
        srv.stop()

    def samples(name: str, suffix: str = "") -> list:
        return [s for s in fams[name].samples if s.name == name + suffix]

    for name in ("request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_params_n"):
        f = fams[f"chatserve:{name}"]
        assert f.type == "histogram", name
        assert samples(f"chatserve:{name}", "_count")[0].value >= 1, name
    assert samples("chatserve:request_params_n", "_sum")[0].value == 2          # one request, n=2
    assert samples("chatserve:request_generation_tokens", "_sum")[0].value == 6  # 2 choices × 3
    assert samples("chatserve:request_prompt_tokens", "_count")[0].value == 1
    info = fams["chatserve:cache_config_info"].samples[0]
    assert info.value == 1 and int(info.labels["block_size"]) > 0 and int(info.labels["num_gpu_blocks"]) > 0

    codes = {(s.labels["code"], s.labels["handler"]): s.value for s in fams["chatserve:http_responses"].samples
             if s.name.endswith("_total")}
    assert codes[("200", "/v1/chat/completions")] == 1 and codes[("200", "/v1/models")] == 1
    assert codes[("404", "other")] == 1                       # unknown paths share one label value
    dur = [s for s in fams["chatserve:http_request_duration_seconds"].samples
           if s.name.endswith("_count") and s.labels["handler"] == "/v1/chat/completions"]
    assert dur and dur[0].value == 1 and dur[0].labels["method"] == "POST"

    parsed = server_metrics.parse(m.text)                     # the bench tools' reader
    assert parsed["chatserve:request_params_n_sum"] == 2
    assert parsed["chatserve:cache_config_info{num_gpu_blocks}"] > 0
    assert server_metrics.parse("<html>not metrics</html>") == {}
