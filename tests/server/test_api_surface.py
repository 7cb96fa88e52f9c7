"""The API surface from one source: /openapi.json (OpenAPI 3.1, every route, generated from the pydantic
models the routes validate with), /docs, the schema fuzz over every operation with the API key, and the
fields that either work or are refused by name (issue 15), finite numbers only (issue 14 item 6)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from server_support import start_fake_server

from chatserve.server.chat_service import FiniteJSONResponse, dumps

KEY = "sk-surface"
M = [{"role": "user", "content": "abc"}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def keyed_server():
    srv = start_fake_server(delay=0.0, api_keys=(KEY,))
    yield srv
    srv.stop()


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def test_openapi_is_valid_3_1_and_covers_every_route(keyed_server):
    from openapi_spec_validator import validate
    spec = httpx.get(keyed_server.url + "/openapi.json", timeout=10).json()
    assert spec["openapi"] == "3.1.0"
    validate(spec)
    app_routes = set()
    for r in keyed_server.server.config.app.routes:
        methods = getattr(r, "methods", None)
        if methods is None or r.path.startswith("/static"):
            continue                                  # the WebSocket (docs/api.md) and the UI's files
        for m in methods - {"HEAD"}:
            app_routes.add((m.lower(), r.path.replace(":path", "")))
    published = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    assert app_routes <= published, app_routes - published
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    # the limits that had drifted out of the hand-written schema
    assert chat["add_generation_prompt"]["type"] == "boolean"
    stop_str = json.dumps(chat["stop"])
    assert '"maxLength": 512' in stop_str and '"maxItems": 16' in stop_str
    assert chat["seed"]["anyOf"][0]["minimum"] == -(2 ** 63)
    assert "pattern" in json.dumps(chat["logit_bias"])
    assert "/v1/sessions/{sid}/messages" in spec["paths"] and "/v1/models/{model_id}" in spec["paths"]
    # issue 31: the Responses API and the reasoning fields
    assert set(spec["paths"]["/v1/responses"]) == {"post"}
    assert set(spec["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "reasoning_effort" in chat
    assert {"reasoning_content", "reasoning"} <= set(spec["components"]["schemas"]["ChatMessage"]["properties"])


def test_docs_api_md_covers_the_responses_and_reasoning_fields():
    """docs/api.md names every field of a /v1/responses request and the reasoning fields of chat."""
    from chatserve.server.openapi import openapi_schema
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    schemas = openapi_schema()["components"]["schemas"]
    fields = [f for f in schemas["ResponsesRequest"]["properties"] if f != "model"]
    missing = [f for f in fields if f"`{f}" not in doc]
    assert not missing, missing
    for name in ("reasoning_content", "reasoning_effort", "reasoning_tokens", "--reasoning-parser",
                 "/v1/responses/{id}", "previous_response_id", "response.reasoning_text.delta", "harmony"):
        assert name in doc, name


def test_docs_page_is_static(keyed_server):
    r = httpx.get(keyed_server.url + "/docs", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<script" not in r.text and "http" not in r.text.replace("/openapi.json", "")
    assert "/v1/chat/completions" in r.text and "/v1/sessions" in r.text


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_every_operation_with_the_api_key(keyed_server, mode):
    """schemathesis over every published operation (sessions included) with the bearer key: never a
    5xx, every 4xx the OpenAI error object."""
    url = keyed_server.url
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    ops = [r.ok() for r in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert len(ops) >= 20
    seen: dict[int, int] = {}
    auth = {"Authorization": f"Bearer {KEY}"}
    for op in ops:
        @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @settings(max_examples=5, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            r = case.call(base_url=url, headers=auth, timeout=30)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500 or (r.status_code == 503 and "retry-after" in r.headers), \
                (op.label, case.body, r.status_code, r.text[:300])
            ctype = r.headers.get("content-type") or ""
            ctype = ctype[0] if isinstance(ctype, list) else ctype
            if r.status_code >= 400 and ctype.startswith("application/json"):
                assert set(r.json()["error"]) == ERROR_KEYS, (op.label, r.text[:300])
        try:
            check()
        except Unsatisfiable:
            assert mode == "negative"
    assert seen.get(400 if mode == "negative" else 200, 0) > 0


REFUSED = [
    ({"messages": M, "functions": []}, "functions"),
    ({"messages": M, "audio": {}}, "audio"),
    # structured outputs and tools work (tests/structured); malformed ones are refused by name
    ({"messages": M, "tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"messages": M, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": M, "tool_choice": "required"}, "tool_choice"),
    ({"messages": M, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": M, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": M, "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x", "nickname": "a"}]}, "messages[0].nickname"),
    ({"messages": M, "repetition_penalty": 1e-38}, "repetition_penalty"),
    ({"messages": M, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"messages": M, "best_of": 2}, "best_of"),
    ({"messages": M, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),   # as vLLM
    ({"messages": M, "continue_final_message": True}, "continue_final_message"),
    ({"messages": M, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": M, "logit_bias": {"x1": 5}}, "logit_bias"),
    ({"messages": M, "seed": 2 ** 64}, "seed"),
    ({"messages": M, "stop": ["x" * 513]}, "stop"),
    ({"messages": M, "user": "u" * 300}, "user"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[p for _, p in REFUSED])
def test_no_field_is_silently_ignored(keyed_server, body, param):
    r = post(keyed_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["param"] == param, err


def test_accepted_fields_work(keyed_server):
    ok = post(keyed_server, "/v1/chat/completions",
              {"messages": [{"role": "developer", "content": "s", "name": "n"}, *M], "max_tokens": 3,
               "user": "alice", "skip_special_tokens": True, "min_tokens": 1, "temperature": 1e-30,
               "response_format": {"type": "text"}, "tool_choice": "none", "stop_token_ids": [5]})
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert "stop_reason" in choice and choice["finish_reason"] == "length"
    r = post(keyed_server, "/v1/chat/completions", {"messages": M, "max_tokens": 8, "stop": ["fg"]})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == "fg", c
    m = httpx.get(keyed_server.url + "/v1/models/fake-model", headers={"Authorization": f"Bearer {KEY}"})
    assert m.status_code == 200 and m.json()["id"] == "fake-model"
    gone = httpx.get(keyed_server.url + "/v1/models/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_best_of_returns_n_of_best_of_samples(keyed_server):
    r = post(keyed_server, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "n": 2, "best_of": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 12           # all best_of samples were generated


def test_echo_with_max_tokens_0_returns_the_prompt(keyed_server):
    r = post(keyed_server, "/v1/completions", {"prompt": ["abc", "de"], "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["abc", "de"]


def test_echo_and_prompt_logprobs_shapes_on_the_fake_engine(keyed_server):
    """The response shapes (values are checked against transformers in tests/clients/test_prompt_logprobs.py)."""
    r = post(keyed_server, "/v1/completions", {"prompt": ["abc", "de"], "max_tokens": 0, "echo": True,
                                               "logprobs": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["abc", "de"]
    lp = choices[0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"] and lp["token_logprobs"] == [None, -0.1, -0.2]
    assert lp["top_logprobs"] == [None, {"a": -0.1, "b": -0.1}, {"a": -0.1, "c": -0.2}]
    assert lp["text_offset"] == [0, 1, 2]
    assert choices[0]["prompt_logprobs"] == [
        None, {"1": {"logprob": -0.1, "rank": 2, "decoded_token": "b"},
               "0": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}},
        {"2": {"logprob": -0.2, "rank": 2, "decoded_token": "c"},
         "0": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}}]
    assert r.json()["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", keyed_server.url + "/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}) as st:
        events = [json.loads(line[6:]) for line in st.iter_lines()
                  if line.startswith("data: {")]
    (first,) = [e for e in events if e["choices"]]
    assert first["choices"][0]["text"] == "abc" and first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.1, -0.2]
    chat = post(keyed_server, "/v1/chat/completions", {"messages": M, "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    plp = chat.json()["prompt_logprobs"]
    assert plp and plp[0] is None and len(plp) == chat.json()["usage"]["prompt_tokens"]


def test_chat_template_options_reach_the_tokenizer(keyed_server):
    seen: list[dict] = []
    tok = keyed_server.state.models.peek(None).tokenizer
    real = tok.apply_chat_template

    def spy(messages, add_generation_prompt=True, **kw):
        seen.append({"add_generation_prompt": add_generation_prompt, **kw})
        return real(messages, add_generation_prompt)
    tok.apply_chat_template = spy
    try:
        r = post(keyed_server, "/v1/chat/completions", {
            "messages": [*M, {"role": "assistant", "content": "de"}], "max_tokens": 1,
            "continue_final_message": True, "chat_template": "{{ messages }}",
            "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        post(keyed_server, "/v1/chat/completions", {"messages": M, "max_tokens": 1})
    finally:
        del tok.apply_chat_template
    assert seen[0] == {"add_generation_prompt": False, "continue_final_message": True,
                       "chat_template": "{{ messages }}", "enable_thinking": False}
    assert seen[1] == {"add_generation_prompt": True}        # nothing set: nothing passed


def test_non_finite_numbers_are_never_written():
    body = {"a": [1.0, float("nan"), float("-inf")], "b": {"c": float("inf")}}
    assert json.loads(dumps(body)) == {"a": [1.0, None, None], "b": {"c": None}}
    assert json.loads(FiniteJSONResponse(body).body) == {"a": [1.0, None, None], "b": {"c": None}}


def test_tiny_repetition_penalty_and_temperature_stay_finite():
    """Issue 14 item 6, from the request body through the server's parsing to the real sampler: the
    smallest accepted repetition_penalty (0.01) and a temperature of 1e-30 (made greedy) give finite
    logprobs; a repetition_penalty of 1e-38 is refused before it reaches the model."""
    import torch
    from chatserve.core.outputs import ScheduledSeq
    from chatserve.runtime.sampler import Sampler
    from chatserve.server import protocol
    from chatserve.server.errors import APIError
    from chatserve.server.schemas import openai as schema
    state = SimpleNamespace(sampling_defaults={}, vocab_size=50, tokenizer=None)

    def params(**body):
        r = protocol.validate(schema.ChatCompletionRequest, {"messages": M, **body})
        return protocol.sampling_params(r, state, n=1, logprobs=5)

    with pytest.raises(APIError) as refused:
        params(repetition_penalty=1e-38)
    assert refused.value.status == 400 and refused.value.param == "repetition_penalty"
    tiny_penalty = params(repetition_penalty=schema.MIN_REPETITION_PENALTY, temperature=0.7)
    tiny_temp = params(temperature=1e-30)
    assert tiny_penalty.repetition_penalty == 0.01 and tiny_temp.temperature == 0.0
    logits = torch.randn(2, 50) * 30
    seqs = [ScheduledSeq(f"r{i}", [1], 0, [0], True, p, [1, 2, 3], [4, 5])
            for i, p in enumerate([tiny_penalty, tiny_temp])]
    toks, lps = Sampler()(logits.clone(), seqs)
    assert toks[1] == int(logits[1].argmax())                      # 1e-30 decodes greedily
    for lp in lps:
        assert math.isfinite(lp.logprob) and all(math.isfinite(v) or v == -math.inf for _, v in lp.top)


def test_min_tokens_masks_eos_in_the_sampler():
    torch = pytest.importorskip("torch")
    from chatserve.core.outputs import ScheduledSeq
    from chatserve.core.request import SamplingParams
    from chatserve.runtime.sampler import Sampler
    logits = torch.zeros(1, 10)
    logits[0, 7] = 50.0                                            # 7 is "EOS" and would always win
    p = SamplingParams(temperature=0.0, min_tokens=3, min_tokens_banned_ids=[7])
    early = ScheduledSeq("r", [1], 0, [0], True, p, [1], [2, 3])
    late = ScheduledSeq("r", [1], 0, [0], True, p, [1], [2, 3, 4])
    assert Sampler()(logits.clone(), [early])[0] != [7]
    assert Sampler()(logits.clone(), [late])[0] == [7]


def test_logprob_bytes_are_the_tokens_own_bytes(tiny_model):
    """A token that is half of a UTF-8 character reports its real bytes, not U+FFFD's."""
    from chatserve.server.logprobs import chat_logprobs
    from chatserve.text import Tokenizer
    tok = Tokenizer.from_model(tiny_model)
    if not tok.is_byte_level:
        pytest.skip("needs a byte-level tokenizer")
    ids = tok.encode("日本語の文章")
    partial = next((i for i in ids if "\ufffd" in tok.token_str(i)), None)
    if partial is None:
        pytest.skip("no partial-character token in this vocabulary")

    class D:
        logprobs = [type("LP", (), {"token_id": partial, "logprob": -1.0, "top": []})()]

    entry = chat_logprobs(tok, D)["content"][0]
    assert entry["bytes"] == list(tok.token_bytes(partial)) and entry["bytes"] != list("\ufffd".encode())

