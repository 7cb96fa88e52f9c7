"""langchain-openai against the real default model: with_structured_output (json_schema and
function_calling) and bind_tools with the tool's result fed back."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20, description="the city")
    country: str = Field(max_length=20, description="its country")


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


@pytest.fixture(scope="module")
def llm(structured_server):
    return langchain_openai.ChatOpenAI(base_url=structured_server.url + "/v1", api_key="none", model="smollm2",
                                       temperature=0, max_tokens=200, timeout=300, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    out = llm.with_structured_output(City, method=method).invoke("Which city is the Eiffel Tower in?")
    assert isinstance(out, City) and out.name


def test_bind_tools_with_the_result_fed_back(llm):
    question = HumanMessage("What is the weather in Paris? Use the tool.")
    ai = llm.bind_tools([get_weather], tool_choice="any").invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    call = ai.tool_calls[0]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = llm.bind_tools([get_weather]).invoke([question, ai, result])
    assert isinstance(final.content, str) and final.content.strip()
