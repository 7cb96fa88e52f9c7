"""Structured outputs and tool calls with the real default model, driven by the official openai client."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2"
PERSON = [{"role": "user", "content": "Describe a person called Ada who is 36 years old, as JSON."}]

NESTED_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "color", "scores", "address", "active"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}},
        "active": {"type": "boolean"},
    },
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone.",
    "parameters": {"type": "object", "required": ["tz"], "additionalProperties": False,
                   "properties": {"tz": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int


def test_parse_with_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=PERSON, response_format=Person, temperature=0,
                                      max_tokens=60)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and r.choices[0].finish_reason == "stop"


def test_json_object(client):
    ask = [{"role": "user", "content": "Give the capital of France as a JSON object with the keys city and country."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_strict_schema_fifty_samples_at_temperature_one(client):
    rf = {"type": "json_schema", "json_schema": {"name": "card", "strict": True, "schema": NESTED_SCHEMA}}

    def samples(seed: int) -> list[tuple[str, str]]:
        r = client.chat.completions.create(model=MODEL, messages=PERSON, response_format=rf, temperature=1.0,
                                           n=10, seed=seed, max_tokens=200)
        return [(c.finish_reason, c.message.content) for c in r.choices]

    with ThreadPoolExecutor(5) as pool:          # five requests at once: 50 sequences in one batch
        outputs = [o for batch in pool.map(samples, range(5)) for o in batch]
    assert len(outputs) == 50
    for reason, text in outputs:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)


def test_streamed_schema_with_logprobs_and_n(client):
    rf = {"type": "json_schema", "json_schema": {"name": "card", "schema": NESTED_SCHEMA}}
    chunks = list(client.chat.completions.create(model=MODEL, messages=PERSON, response_format=rf, n=2,
                                                 temperature=0.7, logprobs=True, top_logprobs=3,
                                                 max_tokens=200, stream=True))
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.logprobs and ch.logprobs.content:   # a forbidden token never shows up as an alternative
                assert all(t.logprob > float("-inf") for t in ch.logprobs.content[0].top_logprobs)
    for t in texts:
        jsonschema.validate(json.loads(t), NESTED_SCHEMA)


def test_regex_choice_and_grammar(client):
    r = client.chat.completions.create(model=MODEL, messages=PERSON, temperature=1.0, max_tokens=20,
                                       response_format={"type": "regex", "regex": r"[A-Z][a-z]{2,8} \d{2}"})
    assert __import__("re").fullmatch(r"[A-Z][a-z]{2,8} \d{2}", r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, max_tokens=10, n=4,
                                       response_format={"type": "choice", "choices": ["sunny", "rainy", "cold"]})
    assert {c.message.content for c in r.choices} <= {"sunny", "rainy", "cold"}
    gbnf = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, max_tokens=10,
                                       response_format={"type": "grammar", "grammar": gbnf})
    assert __import__("re").fullmatch(r"The answer is \d\d?\.", r.choices[0].message.content)


def test_truncated_json_ends_with_length(client):
    rf = {"type": "json_schema", "json_schema": {"name": "card", "schema": NESTED_SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=PERSON, response_format=rf, temperature=0,
                                       max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("response_format,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "not a valid JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "grammar", "grammar": "root ::= ( \"a\""}, "grammar"),
    ({"type": "regex", "regex": "a(b"}, "regex"),
    ({"type": "choice", "choices": []}, "choices"),
    ({"type": "yaml"}, "response_format"),
])
def test_bad_constraints_are_400_naming_the_problem(client, response_format, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=PERSON, response_format=response_format, max_tokens=5)
    assert needle in e.value.message and e.value.body["param"].startswith(("response_format", "tools"))


def test_bad_tool_fields_are_400(client):
    for kwargs, param in [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
                           "tools[0].function.parameters"),
                          ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kwargs)
        assert e.value.body["param"] == param


def _check_call(call, tools=(WEATHER, TIME)):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id and call.type == "function"


def test_required_tool_call_and_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=0, max_tokens=120)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    for call in msg.tool_calls:
        _check_call(call)
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [c.model_dump() for c in msg.tool_calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21, "sky": "clear"}'}
                for c in msg.tool_calls]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], temperature=0,
                                           max_tokens=40)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    assert not final.choices[0].message.tool_calls


def test_named_tool_call_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], stream=True, temperature=1.0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = list(stream)
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])    # then argument fragments
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    # the SDK's own stream accumulator agrees
    with client.chat.completions.stream(
            model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        done = s.get_final_completion()
    _check_call(done.choices[0].message.tool_calls[0])


# Auto mode reads the model's own format (Hermes here). The tiny model seldom decides to call a tool, so a
# regex holds it to one well-formed Hermes call: the parser, not the grammar, turns it into tool_calls.
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_format(client, stream):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", temperature=0,
                  max_tokens=60, response_format={"type": "regex", "regex": HERMES_CALL})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
        assert deltas and deltas[0].function.name == "get_weather"
        args = "".join(d.function.arguments or "" for d in deltas)
        assert json.loads(args)["unit"] == "celsius"
        assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices).strip()
    else:
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_call(r.choices[0].message.tool_calls[0])


def test_auto_without_a_call_is_plain_content(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       tools=[WEATHER], temperature=0, max_tokens=20,
                                       response_format={"type": "choice", "choices": ["Hello there!"]})
    assert r.choices[0].message.content == "Hello there!" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_unconstrained_requests_are_unchanged(client, structured_server):
    r = httpx.post(structured_server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0,
                         "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
