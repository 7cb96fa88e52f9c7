"""OpenAI chat fields that change nothing about the output are accepted (service_tier echoed), fields
that would change it and are unsupported keep their 400 naming the field, and the tool-call turn shape
(assistant content null with tool_calls) is accepted, on the scripted engine with the official SDK."""
from __future__ import annotations

import httpx
import openai
import pytest

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(shared_fake_server):
    return openai.OpenAI(base_url=shared_fake_server.url + "/v1", api_key="none", max_retries=0)


def test_no_op_fields_accepted_and_echoed(client):
    r = client.chat.completions.create(model="fake-model", messages=HI, max_tokens=3, service_tier="flex",
                                       metadata={"run": "7"}, store=False, prompt_cache_key="k",
                                       safety_identifier="u-1", modalities=["text"], reasoning_effort="low")
    assert r.service_tier == "default" and r.choices[0].message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(client.chat.completions.create(model="fake-model", messages=HI, max_tokens=3, stream=True,
                                                 service_tier="auto"))
    assert chunks and all(c.service_tier == "default" for c in chunks)


def test_no_service_tier_no_echo(client):
    r = client.chat.completions.create(model="fake-model", messages=HI, max_tokens=2)
    assert r.service_tier is None


@pytest.mark.parametrize("field,value", [("audio", {"voice": "alloy", "format": "wav"}),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]),
                                         ("web_search_options", {}), ("verbosity", "low")])
def test_output_changing_fields_are_400(shared_fake_server, field, value):
    r = httpx.post(shared_fake_server.url + "/v1/chat/completions",
                   json={"messages": HI, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].split("[")[0] == field


def test_tool_call_turn_with_null_content(client):
    msgs = [*HI, {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    r = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=2)
    assert r.choices[0].message.content
