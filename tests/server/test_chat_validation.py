"""A chat body is validated once (issue 29 item 2): the request schema validates it, and everything after
reads the validated model (messages, tool history, max_tokens), never the raw body again. Only the inner
shapes the schema leaves open (each tool's definition) are validated later, once each."""
from __future__ import annotations

import httpx
import pydantic

from chatserve.server import protocol
from chatserve.server.schemas.openai import ChatMessage

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
BODY = {"model": "fake-model", "max_completion_tokens": 4, "messages": [
    {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "thanks"}]}


def test_chat_body_is_validated_once_and_read_from_the_model(fake_server, monkeypatch):
    validated: list[str] = []
    original = pydantic.BaseModel.model_validate.__func__

    def counting(cls, obj, *a, **k):
        validated.append(cls.__name__)
        return original(cls, obj, *a, **k)
    monkeypatch.setattr(pydantic.BaseModel, "model_validate", classmethod(counting))
    seen: dict[str, object] = {}
    normalize, max_tokens = protocol.normalize_messages, protocol.max_tokens_for

    def spy_normalize(messages):
        seen["messages"] = messages
        return normalize(messages)

    def spy_max_tokens(requested, *a, **k):
        seen["requested"] = requested
        return max_tokens(requested, *a, **k)
    monkeypatch.setattr(protocol, "normalize_messages", spy_normalize)
    monkeypatch.setattr(protocol, "max_tokens_for", spy_max_tokens)

    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    assert validated == ["ChatCompletionRequest"]                     # the body, once
    assert all(isinstance(m, ChatMessage) for m in seen["messages"])  # the template reads the validated models
    assert seen["requested"] == ("max_completion_tokens", 4)          # max_tokens from the model, not the dict

    validated.clear()
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "max_tokens": 2, "tools": [TOOL], "tool_choice": "none",   # (no tool prompt)
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert validated == ["ChatCompletionRequest", "Tool"]   # the tool's inner shape, which the schema leaves open
