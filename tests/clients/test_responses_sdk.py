"""/v1/responses against the real default model, read by the official openai SDK (create, stream, chain,
a function-tool round trip, responses.parse with a pydantic model) and run by the OpenAI Agents SDK (an
agent with one function tool). Outputs are held to valid shapes by grammars (tool_choice, text.format),
never to the words a 135M model picks."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Rome"]}}}, "strict": True}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_create_stream_and_chain(client):
    r = client.responses.create(model="smollm2", input="Say hello.", max_output_tokens=8, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    with client.responses.stream(model="smollm2", input="Say hello.", max_output_tokens=8, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert deltas and "".join(deltas) == final.output_text
    chained = client.responses.create(model="smollm2", input="Again.", max_output_tokens=4, temperature=0,
                                      previous_response_id=r.id)
    assert chained.previous_response_id == r.id
    assert chained.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert chained.usage.input_tokens_details.cached_tokens > 0             # the chain's prefix was reused


def test_function_tool_round_trip(client):
    first = client.responses.create(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                    temperature=0)
    calls = [it for it in first.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert args["city"] in ("Paris", "Rome")
    second = client.responses.create(
        model="smollm2", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}])
    assert second.status in ("completed", "incomplete")
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    sky: Literal["sunny", "cloudy", "rain"]


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model="smollm2", input="Weather in Rome, as JSON.", text_format=Weather,
                               max_output_tokens=64, temperature=0)
    assert isinstance(r.output_parsed, Weather)


def test_agents_sdk_runs_a_function_tool(live_server):
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"Sunny in {city}"

    ext = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    # the tool's result is the answer (a 135M model's free text after it could run past any max_tokens)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="smollm2", openai_client=ext),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                               temperature=0),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert called and called[0] in ("Paris", "Rome")
    assert result.final_output == f"Sunny in {called[0]}"
    assert agents is not None
