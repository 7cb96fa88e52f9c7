"""gpt-oss through the API: a tiny GptOssConfig checkpoint (MoE, attention sinks) with the real harmony chat
template, its output scripted (think_models.gpt_oss_chains): the final channel as content, the analysis
channel as reasoning_content (and `<|end|>` not ending the reply), a commentary-channel call as a tool call,
streamed and not, read by the official openai SDK; tool_choice required; reasoning_effort as the template's
level; a tool-call turn replayed as OpenAI sends it renders as transformers renders the gpt-oss template."""
from __future__ import annotations

import json

import httpx
import openai

from think_models import BRANCH_BIAS, HARMONY_THOUGHT, NOW_ARGS

ANSWER = "Hello there!"
THOUGHT = "".join(HARMONY_THOUGHT)
HI = [{"role": "user", "content": "hi"}]
NOW_TOOL = {"type": "function", "function": {"name": "now", "description": "the time",
                                             "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                            "required": ["tz"]}}}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _bias(srv, *pieces: str) -> dict[str, int]:
    """logit_bias on each piece's first token: picks a scripted branch (think_models.gpt_oss_chains)."""
    ids = [httpx.post(srv.url + "/tokenize", json={"prompt": p}).json()["tokens"][0] for p in pieces]
    return {str(i): BRANCH_BIAS for i in ids}


def _stream(client, **kw) -> tuple[str, str, list, str | None]:
    reasoning, content, calls, reason = "", "", [], None
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            d = ch.delta.model_dump()
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            calls += d.get("tool_calls") or []
            reason = ch.finish_reason or reason
    return reasoning, content, calls, reason


def test_final_channel_is_the_content(gpt_oss_server):
    c = _client(gpt_oss_server)
    r = c.chat.completions.create(model="gpt_oss", messages=HI, temperature=0)
    msg = r.choices[0].message.model_dump()
    assert (msg["content"], msg.get("reasoning_content"), r.choices[0].finish_reason) == (ANSWER, None, "stop")
    assert _stream(c, model="gpt_oss", messages=HI, temperature=0) == ("", ANSWER, [], "stop")


def test_analysis_channel_is_reasoning_and_end_does_not_stop(gpt_oss_server):
    """The analysis message ends with `<|end|>`; the reply goes on (the script repeats the message) until
    max_tokens: reasoning_content holds the thought twice, and nothing of the framing."""
    c = _client(gpt_oss_server)
    kw = dict(model="gpt_oss", messages=HI, temperature=0, max_tokens=30,
              logit_bias=_bias(gpt_oss_server, "analysis", "Okay"))
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message.model_dump()
    assert r.choices[0].finish_reason == "length" and msg["content"] is None
    assert msg["reasoning_content"].startswith(THOUGHT + THOUGHT) and "<|" not in msg["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 30
    reasoning, content, calls, reason = _stream(c, **kw)
    assert (reasoning, content, calls, reason) == (msg["reasoning_content"], "", [], "length")


def test_commentary_call_is_a_tool_call(gpt_oss_server):
    c = _client(gpt_oss_server)
    kw = dict(model="gpt_oss", messages=HI, temperature=0, tools=[NOW_TOOL],
              logit_bias=_bias(gpt_oss_server, "comment", NOW_ARGS))
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == \
        [("now", json.loads(NOW_ARGS))]
    reasoning, content, calls, reason = _stream(c, **kw)
    assert reason == "tool_calls" and content == "" and calls[0]["function"]["name"] == "now"
    assert json.loads("".join(d["function"]["arguments"] or "" for d in calls)) == json.loads(NOW_ARGS)


def test_required_tool_choice_forces_a_call(gpt_oss_server):
    """tool_choice required: the grammar forces the call array from the first token (harmony's headers are
    several tokens: no end-of-thinking token to start after); the call's arguments parse."""
    tool = {"type": "function", "function": {"name": "now", "description": "the time",
                                             "parameters": {"type": "object", "properties": {},
                                                            "additionalProperties": False}}}
    r = _client(gpt_oss_server).chat.completions.create(
        model="gpt_oss", messages=HI, temperature=0, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [("now", {})]


def test_replayed_call_renders_as_transformers_does(gpt_oss_server, tmp_path):
    """The tool-call turn as OpenAI clients send it back (arguments as JSON text) gives the prompt that
    transformers' apply_chat_template gives for the arguments object the gpt-oss template expects."""
    import transformers
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": NOW_ARGS}}
    msgs = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    ours = httpx.post(gpt_oss_server.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    srv_dir = _checkpoint_dir(gpt_oss_server)
    tok = transformers.AutoTokenizer.from_pretrained(srv_dir)
    ref_msgs = json.loads(json.dumps(msgs))
    ref_msgs[1]["content"] = ""
    ref_msgs[1]["tool_calls"][0]["function"]["arguments"] = json.loads(NOW_ARGS)
    ref = tok.apply_chat_template(ref_msgs, add_generation_prompt=True, tokenize=False)
    assert ours == tok.encode(ref, add_special_tokens=False)
    assert '<|message|>{"tz": "UTC"}<|call|>' in ref
    r = _client(gpt_oss_server).chat.completions.create(model="gpt_oss", messages=msgs, temperature=0)
    assert r.choices[0].message.content == ANSWER


def _checkpoint_dir(srv) -> str:
    return httpx.get(srv.url + "/v1/models").json()["data"][0]["root"]


def test_reasoning_effort_is_the_templates_level(gpt_oss_server):
    """reasoning_effort reaches gpt-oss's template as its `reasoning_effort` ("none" as "low", its lowest):
    the prompt's tokens (read back as prompt_logprobs) are what /tokenize renders with that level."""
    url = gpt_oss_server.url

    def rendered(level: str | None) -> list[int]:
        body = {"messages": HI, **({"chat_template_kwargs": {"reasoning_effort": level}} if level else {})}
        return httpx.post(url + "/tokenize", json=body).json()["tokens"]

    assert rendered("high") != rendered(None) != rendered("low")
    for effort, level in (("high", "high"), ("none", "low")):
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "gpt_oss", "messages": HI, "reasoning_effort": effort, "prompt_logprobs": 0,
            "max_tokens": 1}).json()
        ids = [int(next(iter(e))) for e in r["prompt_logprobs"][1:]]
        assert ids == rendered(level)[1:], effort
