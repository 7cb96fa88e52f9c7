"""Request defaults an operator or the model sets (issue 23): --max-tokens-default caps a request that
sets no max_tokens and shows in /v1/models; the model's generation-config sampling values fill the
fields a client left unset, never the ones it sent."""
from __future__ import annotations

import dataclasses

import httpx
import pytest

from chatserve.server import protocol
from server_support import start_fake_server


def test_max_tokens_default_applies_and_is_shown():
    srv = start_fake_server(max_tokens_default=3)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            card = c.get("/v1/models").json()["data"][0]
            assert card["max_tokens_default"] == 3
            assert c.get(f"/v1/models/{card['id']}").json()["max_tokens_default"] == 3
            r = c.post("/v1/completions", json={"model": card["id"], "prompt": "hello there"})
            assert r.status_code == 200, r.text
            assert 0 < r.json()["usage"]["completion_tokens"] <= 3
            r = c.post("/v1/completions", json={"model": card["id"], "prompt": "hello there", "max_tokens": 5})
            assert r.json()["usage"]["completion_tokens"] == 5          # an explicit value wins
    finally:
        srv.stop()


def test_without_a_default_the_model_card_says_null():
    srv = start_fake_server()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v1/models").json()["data"][0]["max_tokens_default"] is None
    finally:
        srv.stop()


def test_generation_config_fills_only_unset_sampling_fields():
    srv = start_fake_server()
    try:
        served = dataclasses.replace(srv.state.models.peek(None), sampling_defaults={
            "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7})
        unset = protocol.parse_completion_body({"prompt": "hi"}, served)
        assert (unset.params.temperature, unset.params.top_p, unset.params.top_k) == (0.6, 0.9, 20)
        assert unset.params.max_tokens == 7
        sent = protocol.parse_completion_body({"prompt": "hi", "temperature": 0, "top_p": 1.0}, served)
        assert (sent.params.temperature, sent.params.top_p, sent.params.top_k) == (0.0, 1.0, 20)
    finally:
        srv.stop()


def test_a_gguf_files_sampling_keys_are_its_defaults_and_the_model_card_shows_them(tmp_path):
    """--generation-config auto reads llama.cpp's general.sampling.* keys from a GGUF model (the ones
    chatserve has fields for); none and vllm keep OpenAI's defaults; a GGUF without the keys gives {}."""
    import gguf

    from chatserve.config import ModelConfig, default_model_path
    from chatserve.generation_defaults import load_generation_defaults
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.7)
    w.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 20)
    w.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.8)
    w.add_float32(gguf.Keys.General.SAMPLING_MIN_P, 0.0)
    w.add_float32(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, 1.05)
    w.add_float32(gguf.Keys.General.SAMPLING_XTC_PROBABILITY, 0.5)     # no such field here: left out
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = load_generation_defaults(ModelConfig(model=str(path)))
    assert got == {"temperature": pytest.approx(0.7), "top_k": 20, "top_p": pytest.approx(0.8), "min_p": 0.0,
                   "repetition_penalty": pytest.approx(1.05)}
    assert isinstance(got["top_k"], int)
    for choice in ("none", "vllm"):
        assert load_generation_defaults(ModelConfig(model=str(path), generation_config=choice)) == {}
    assert load_generation_defaults(ModelConfig(model=default_model_path())) == {}     # ships none

    srv = start_fake_server(sampling_defaults={**got, "max_tokens": 9})
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            card = c.get("/v1/models").json()["data"][0]
        assert card["sampling_defaults"] == {k: pytest.approx(v) for k, v in got.items()}
        assert card["thinking_switch"] is False                      # the fake tokenizer has no template
    finally:
        srv.stop()
