"""Reasoning through the API on tiny Qwen3 and DeepSeek-R1-style checkpoints with their chat templates,
their output scripted (think_models.py): reasoning_content beside content, streamed and not, cut by
max_tokens, thinking switched off, with response_format and tools (the grammar starts after `</think>`),
a replayed reasoning_content, and the Responses API's reasoning items, read by the official SDK, by
langchain-openai and by langchain-deepseek."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

THOUGHT = "Okay, the user says hi."
ANSWER = "Hello there!"
HI = [{"role": "user", "content": "hi"}]
NOW_TOOL = {"type": "function", "function": {"name": "now", "description": "the time",
                                             "parameters": {"type": "object", "properties": {},
                                                            "additionalProperties": False}}}
CALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
               "properties": {"name": {"const": "now"}, "arguments": {"type": "object", "maxProperties": 0}}}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _stream(client, **kw) -> tuple[str, str, list[str], object]:
    """(reasoning, content, kinds in order, last usage) of a streamed chat completion."""
    reasoning, content, kinds, usage = "", "", [], None
    for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = c.usage or usage
        for ch in c.choices:
            d = ch.delta.model_dump()
            if d.get("reasoning_content"):
                reasoning += d["reasoning_content"]
                kinds.append("r")
            if d.get("content"):
                content += d["content"]
                kinds.append("c")
    return reasoning, content, kinds, usage


# ── Qwen3: the model opens the block ────────────────────────────────────────────────────────────
def test_qwen3_reasoning_beside_content(qwen3_server):
    c = _client(qwen3_server)
    r = c.chat.completions.create(model="qwen3", messages=HI, temperature=0)
    msg = r.choices[0].message.model_dump()
    assert msg["content"] == ANSWER and "<think>" not in msg["content"]
    assert msg["reasoning_content"] == THOUGHT and msg["reasoning"] == THOUGHT
    assert r.usage.completion_tokens_details.reasoning_tokens == 9       # <think>, 7 thought tokens, </think>
    reasoning, content, kinds, usage = _stream(c, model="qwen3", messages=HI, temperature=0)
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds    # reasoning first
    assert usage.completion_tokens_details.reasoning_tokens == 9


def test_qwen3_cut_off_while_thinking(qwen3_server):
    c = _client(qwen3_server)
    r = c.chat.completions.create(model="qwen3", messages=HI, temperature=0, max_tokens=4)
    msg = r.choices[0].message.model_dump()
    assert r.choices[0].finish_reason == "length"
    assert msg["content"] is None and msg["reasoning_content"] == "Okay, the"
    reasoning, content, _, _ = _stream(c, model="qwen3", messages=HI, temperature=0, max_tokens=4)
    assert (reasoning, content) == ("Okay, the", "")


@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"},
                                    {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}])
def test_qwen3_thinking_off(qwen3_server, switch):
    c = _client(qwen3_server)
    r = c.chat.completions.create(model="qwen3", messages=HI, temperature=0, **switch)
    msg = r.choices[0].message.model_dump()
    assert msg["content"] == ANSWER and msg["reasoning_content"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_qwen3_effort_keeps_thinking_on(qwen3_server):
    r = _client(qwen3_server).chat.completions.create(model="qwen3", messages=HI, temperature=0,
                                                      reasoning_effort="high")
    assert r.choices[0].message.model_dump()["reasoning_content"] == THOUGHT


@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}}])
def test_qwen3_response_format_after_thinking(qwen3_server, fmt):
    """The grammar starts after </think>: the model still thinks, then writes the JSON."""
    c = _client(qwen3_server)
    r = c.chat.completions.create(model="qwen3", messages=HI, temperature=0, response_format=fmt)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] == THOUGHT
    assert json.loads(msg["content"]) == {"name": "now", "arguments": {}}
    reasoning, content, _, _ = _stream(c, model="qwen3", messages=HI, temperature=0, response_format=fmt)
    assert reasoning == THOUGHT and json.loads(content) == {"name": "now", "arguments": {}}


def _tool_bias(srv) -> dict[str, int]:
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "<tool_call>"}).json()["tokens"]
    assert len(ids) == 1
    return {str(ids[0]): 20}          # the scripted tool-call branch outweighs the answer


def test_qwen3_tool_call_after_thinking(qwen3_server):
    c = _client(qwen3_server)
    kw = dict(model="qwen3", messages=HI, temperature=0, tools=[NOW_TOOL], logit_bias=_tool_bias(qwen3_server))
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.model_dump()["reasoning_content"] == THOUGHT
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [("now", {})]
    assert not ch.message.content
    calls, reasoning = {}, ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        for x in chunk.choices:
            reasoning += x.delta.model_dump().get("reasoning_content") or ""
            for t in x.delta.tool_calls or ():
                calls.setdefault(t.index, "")
                calls[t.index] += t.function.arguments or ""
    assert reasoning == THOUGHT and [json.loads(a) for a in calls.values()] == [{}]


def test_qwen3_named_tool_choice_after_thinking(qwen3_server):
    r = _client(qwen3_server).chat.completions.create(
        model="qwen3", messages=HI, temperature=0, tools=[NOW_TOOL],
        tool_choice={"type": "function", "function": {"name": "now"}})
    ch = r.choices[0]
    assert ch.message.model_dump()["reasoning_content"] == THOUGHT
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [("now", {})]


def test_replayed_reasoning_reaches_the_template(qwen3_server):
    """An assistant turn replaying reasoning_content (and content null with tool_calls) is accepted and
    rendered by the template (Qwen3 keeps it for turns after the last user message)."""
    msgs = [{"role": "user", "content": "what time is it?"},
            {"role": "assistant", "content": None, "reasoning_content": "I should call now.",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    tok = httpx.post(qwen3_server.url + "/tokenize", json={"messages": msgs, "tools": None} if False else
                     {"messages": msgs, "return_token_strs": True})
    assert tok.status_code == 200, tok.text
    text = httpx.post(qwen3_server.url + "/detokenize", json={"tokens": tok.json()["tokens"]}).json()["prompt"]
    assert "<think>\nI should call now.\n</think>" in text
    r = _client(qwen3_server).chat.completions.create(model="qwen3", messages=msgs, tools=[NOW_TOOL],
                                                      temperature=0)
    assert r.choices[0].message.model_dump()["reasoning_content"] == THOUGHT
    bad = httpx.post(qwen3_server.url + "/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].reasoning_content"


# ── DeepSeek-R1: the template opens the block ─────────────────────────────────────────────────────
def test_deepseek_template_opened_block(r1_server):
    c = _client(r1_server)
    r = c.chat.completions.create(model="deepseek_r1", messages=HI, temperature=0)
    msg = r.choices[0].message.model_dump()
    assert (msg["reasoning_content"], msg["content"]) == (THOUGHT, ANSWER)
    assert r.usage.completion_tokens_details.reasoning_tokens == 8       # 7 thought tokens and </think>
    assert _stream(c, model="deepseek_r1", messages=HI, temperature=0)[:2] == (THOUGHT, ANSWER)
    cut = c.chat.completions.create(model="deepseek_r1", messages=HI, temperature=0, max_tokens=3)
    assert cut.choices[0].message.model_dump()["reasoning_content"] == "Okay, the"
    assert cut.choices[0].message.content is None
    js = c.chat.completions.create(model="deepseek_r1", messages=HI, temperature=0,
                                   response_format={"type": "json_object"})
    assert js.choices[0].message.model_dump()["reasoning_content"] == THOUGHT
    assert json.loads(js.choices[0].message.content) == {"name": "now", "arguments": {}}


# ── the Responses API ──────────────────────────────────────────────────────────────────────────────
def test_responses_reasoning_items(qwen3_server):
    c = _client(qwen3_server)
    r = c.responses.create(model="qwen3", input="hi", temperature=0, reasoning={"summary": "auto"})
    kinds = [it.type for it in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    assert r.output[0].summary == [] and r.reasoning.summary == "auto"     # no summary is ever invented
    assert r.usage.output_tokens_details.reasoning_tokens == 9
    with c.responses.stream(model="qwen3", input="hi", temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (THOUGHT, ANSWER) and final.output_text == ANSWER
    first_text = next(i for i, e in enumerate(events) if e.type == "response.output_text.delta")
    assert all(e.type != "response.reasoning_text.delta" for e in events[first_text:])


def test_responses_chain_hits_the_prefix_cache(qwen3_server):
    """A chained response reuses the cached prompt of the one before (the template drops the earlier
    reasoning, so the previous prompt's full blocks are what can match)."""
    c = _client(qwen3_server)
    long = "Please remember this list: " + ", ".join(f"item {i}" for i in range(40)) + "."
    first = c.responses.create(model="qwen3", input=long, temperature=0)
    second = c.responses.create(model="qwen3", input="hi", temperature=0, previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (first.usage.input_tokens // 16) - 16 > 0
    assert second.output_text == ANSWER


def test_langchain_reads_reasoning(qwen3_server):
    """langchain-openai on the Responses API: the reasoning comes back as a reasoning content block."""
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model="qwen3", base_url=qwen3_server.url + "/v1", api_key="none", temperature=0,
                     use_responses_api=True, max_retries=0)
    msg = llm.invoke("hi")
    blocks = msg.content_blocks
    reasoning = [b for b in blocks if b["type"] == "reasoning"]
    assert reasoning and THOUGHT in json.dumps(reasoning)
    assert msg.text == ANSWER
    chat = ChatOpenAI(model="qwen3", base_url=qwen3_server.url + "/v1", api_key="none", temperature=0,
                      max_retries=0).invoke("hi")
    assert chat.text == ANSWER                          # no <think> block left in the content


def test_langchain_deepseek_reads_reasoning_content(qwen3_server):
    """langchain on chat completions: ChatOpenAI drops `reasoning_content`; langchain-deepseek's ChatDeepSeek
    (an OpenAI-compatible client) surfaces it in additional_kwargs, streamed and not."""
    from langchain_deepseek import ChatDeepSeek
    llm = ChatDeepSeek(model="qwen3", base_url=qwen3_server.url + "/v1", api_key="none", temperature=0,
                       max_retries=0)
    msg = llm.invoke("hi")
    assert msg.additional_kwargs["reasoning_content"] == THOUGHT and msg.content == ANSWER
    chunks = list(llm.stream("hi"))
    streamed = "".join(c.additional_kwargs.get("reasoning_content") or "" for c in chunks)
    assert streamed == THOUGHT and "".join(c.content for c in chunks) == ANSWER


def test_qwen3_required_tool_call_after_thinking(qwen3_server):
    """tool_choice required: the forced array starts after </think>; every call's arguments parse."""
    r = _client(qwen3_server).chat.completions.create(
        model="qwen3", messages=HI, temperature=0, tools=[NOW_TOOL], tool_choice="required",
        parallel_tool_calls=False, max_tokens=40)
    ch = r.choices[0]
    assert ch.message.model_dump()["reasoning_content"] == THOUGHT
    assert ch.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [("now", {})]


def test_responses_function_call_after_reasoning(qwen3_server):
    c = _client(qwen3_server)
    tool = {"type": "function", "name": "now", "parameters": NOW_TOOL["function"]["parameters"]}
    r = c.responses.create(model="qwen3", input="hi", temperature=0, tools=[tool],
                           tool_choice={"type": "function", "name": "now"})
    assert [it.type for it in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "now" and json.loads(call.arguments) == {} and call.call_id
    with c.responses.stream(model="qwen3", input="hi", temperature=0, tools=[tool],
                            tool_choice={"type": "function", "name": "now"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.function_call_arguments.delta")
    assert [it.type for it in final.output] == ["reasoning", "function_call"]
    follow = c.responses.create(model="qwen3", previous_response_id=r.id, temperature=0,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "noon"}])
    assert follow.output_text == ANSWER


def test_agents_sdk_replays_reasoning_items(qwen3_server):
    """An Agents SDK run on the reasoning model: turn 1 thinks and calls the tool (required); turn 2 gets
    the reasoning item, the call and its output back as input items, thinks again and answers."""
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def now() -> str:
        """the time"""
        called.append("now")
        return "noon"

    ext = openai.AsyncOpenAI(base_url=qwen3_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    agent = Agent(name="clock", instructions="Use the tool.", tools=[now],
                  model=OpenAIResponsesModel(model="qwen3", openai_client=ext),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0))
    result = Runner.run_sync(agent, "hi", max_turns=3)
    assert called == ["now"] and result.final_output == ANSWER
    kinds = [type(it).__name__ for it in result.new_items]
    assert kinds[0] == "ReasoningItem" and "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds
