"""Client software nobody here wrote, against the server with an API key: the official openai Python SDK
(chat and completions, streamed and not, models.retrieve), langchain-openai's ChatOpenAI (invoke and
stream) and the official openai npm package (run with node; skipped only when node/npm are absent)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import openai
import pytest

MSG = [{"role": "user", "content": "abc"}]
NODE_DIR = os.path.join(os.path.dirname(__file__), "node")


@pytest.fixture(scope="module")
def client(api_server, api_key):
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def test_openai_chat_streamed_and_not(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=4)
    assert r.choices[0].message.content == "defg" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == "d"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "defg"
    assert chunks[-1].usage.completion_tokens == 4


def test_openai_completions_streamed_and_not_and_a_batch(client):
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=3)
    assert r.choices[0].text == "def"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="fake-model", prompt="abc", max_tokens=3, stream=True) if c.choices)
    assert text == "def"
    b = client.completions.create(model="fake-model", prompt=["abc", "xy"], max_tokens=2, n=2)
    assert [c.index for c in b.choices] == list(range(4))      # prompt p, sample j: index p * n + j
    assert [c.text for c in b.choices] == ["de", "de", "zA", "zA"]
    assert b.usage.prompt_tokens == 5 and b.usage.completion_tokens == 8
    t = client.completions.create(model="fake-model", prompt=[[5, 6], [1]], max_tokens=1, echo=True)
    assert [c.text for c in t.choices] == ["fgh", "bc"]


def test_openai_models_retrieve_and_stop_reason(client):
    m = client.models.retrieve("fake-model")
    assert m.id == "fake-model" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    r = client.chat.completions.create(model="fake-model", messages=MSG, max_tokens=8, stop=["fg"])
    assert r.choices[0].message.content == "de" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "fg"


def test_openai_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSG, extra_body={"guided_json": {}})
    assert e.value.body["param"] == "guided_json" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSG, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_langchain_chat_openai_invoke_and_stream(api_server, api_key):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=api_server.url + "/v1", api_key=api_key, model="fake-model",
                                      max_tokens=4, max_retries=0, timeout=60)
    assert llm.invoke("abc").content == "defg"
    parts = [c.content for c in llm.stream("abc")]
    assert "".join(parts) == "defg" and len([p for p in parts if p]) >= 2


def test_openai_npm_package(api_server, api_key):
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node/npm not installed")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "openai")):
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300,
                       capture_output=True)
    p = subprocess.run([node, "client.mjs", api_server.url, api_key], cwd=NODE_DIR, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["model"] == "fake-model" and out["chat"] == "defg" and out["completion"] == "defg"
    assert out["chunks"][0] == {"role": "assistant", "content": "d"}
    assert "".join(c["content"] or "" for c in out["chunks"]) == "defg" and out["usage"] == 4
