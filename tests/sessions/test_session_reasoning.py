"""A reasoning model's thinking in sessions: stored with the reply apart from the answer (real Redis),
replayed to a follower, exported and imported, and handed to the chat template as `reasoning_content`
so the template decides whether the next prompt shows it."""
from __future__ import annotations

import json

import httpx
import pytest

from chatserve.server.sessions.rewarm import next_prompt_prefix
from chatserve.server.sessions.session import history_message
from chatserve.server.shared_prompts import common_prefix_len
from session_fakes import ScriptedChat, make_app

pytestmark = pytest.mark.timeout(60)

# A Qwen3-style template, written for this test: a reply's reasoning shows only for the turns after the
# last user message (a tool loop); earlier turns keep only the answer.
QWEN3_STYLE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# A template that keeps thinking in history (as some distills do).
KEEPS_THINKING = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def thinking_chat() -> ScriptedChat:
    chat = ScriptedChat(reply=lambda m: f"answer to {m[-1]['content']}")
    chat.think = lambda m: f"pondering {m[-1]['content']} carefully"
    return chat


async def test_reasoning_is_stored_apart_and_goes_back_to_the_template(redis_server):
    chat = thinking_chat()
    app = make_app(chat, redis_url=redis_server.url)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={"params": {"reasoning_effort": "high"}})).json()["id"]
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"content": "one"})
        assert r.status_code == 200
        streamed = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        deltas = [ch["delta"] for x in streamed for ch in x.get("choices", [])]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "pondering one carefully"
        assert "".join(d.get("content", "") for d in deltas) == "answer to one"
        await c.post(f"/v1/sessions/{sid}/messages", json={"content": "two", "reasoning_effort": "none"})
        cookie = c.cookies.get("chatserve_uid")
    await app.state.session_store.aclose()

    # the first turn's request: the session's thinking switch; the second: the turn's override
    assert chat.requests[0]["req"]["reasoning_effort"] == "high"
    assert chat.requests[1]["req"]["reasoning_effort"] == "none"
    # the second turn's history hands the first reply's reasoning to the template, apart from the answer
    history = chat.requests[1]["req"]["messages"]
    assert history[1] == {"role": "assistant", "content": "answer to one",
                          "reasoning_content": "pondering one carefully"}
    # after each reply with reasoning, the history is re-prefilled as the next prompt will start
    assert [r["messages"] for r in chat.rewarms] == [history[:2], chat.requests[1]["req"]["messages"][:3] + [
        {"role": "assistant", "content": "answer to two", "reasoning_content": "pondering two carefully"}]]
    assert {r["owner"] for r in chat.rewarms} == {chat.requests[0]["owner"]}

    app2 = make_app(chat, redis_url=redis_server.url)                  # a new process, the same Redis
    async with client(app2) as c:
        c.cookies.set("chatserve_uid", cookie)
        msgs = (await c.get(f"/v1/sessions/{sid}")).json()["messages"]
        replies = [m for m in msgs if m["role"] == "assistant"]
        assert [m["content"] for m in replies] == ["answer to one", "answer to two"]
        assert [m["reasoning_content"] for m in replies] == ["pondering one carefully", "pondering two carefully"]
        assert replies[0]["usage"]["reasoning_tokens"] == 3 and replies[0]["usage"]["reasoning_s"] >= 0
        doc = (await c.get(f"/v1/sessions/{sid}/export")).json()
        assert [m.get("reasoning_content") for m in doc["messages"]] == [
            None, "pondering one carefully", None, "pondering two carefully"]
        assert doc["tree"]["nodes"][1]["reasoning_content"] == "pondering one carefully"
        new = (await c.post("/v1/sessions/import", json=doc)).json()      # the thinking comes back in
        assert [m.get("reasoning_content") for m in new["messages"]] == [
            None, "pondering one carefully", None, "pondering two carefully"]
        bad = dict(doc, tree=None, messages=[{"role": "assistant", "content": "a", "reasoning_content": 3}])
        assert (await c.post("/v1/sessions/import", json=bad)).status_code == 400
        r = await c.patch(f"/v1/sessions/{sid}", json={"params": {"reasoning_effort": "max"}})
        assert r.status_code == 400 and "reasoning_effort" in r.text
    await app2.state.session_store.aclose()


async def test_a_follower_that_reattaches_gets_the_thinking_so_far():
    import asyncio
    chat = thinking_chat()
    chat.think_gate = asyncio.Event()                    # the answer waits: the turn is mid-thought
    app = make_app(chat)
    async with client(app) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        task = asyncio.create_task(c.post(f"/v1/sessions/{sid}/messages", json={"content": "deep"}))
        turns = app.state.session_turns
        for _ in range(500):
            await asyncio.sleep(0.01)
            t = turns.by_session.get(sid)
            if t is not None and len(t.reasoning) == 3:
                break
        first = None
        agen = turns.attach(turns.by_session[sid].owner, sid)
        async for item in agen:
            if item.get("object") == "chat.completion.chunk":
                first = item
                break
        await agen.aclose()
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "",
                                                "reasoning_content": "pondering deep carefully"}
        chat.think_gate.set()
        assert (await task).status_code == 200


def test_the_chat_template_decides_whether_later_prompts_show_the_reasoning():
    from chatserve.config import default_model_path
    from chatserve.text.tokenizer import Tokenizer
    tok = Tokenizer.from_model(default_model_path())
    stored = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back", "usage": {}},
              {"role": "user", "content": "bye"}]
    msgs = [history_message(m) for m in stored]
    assert msgs[1] == {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"}
    stripped = tok.render_chat(msgs, chat_template=QWEN3_STYLE)
    assert "greet back" not in stripped and "<|im_start|>assistant\nHello!<|im_end|>" in stripped
    kept = tok.render_chat(msgs, chat_template=KEEPS_THINKING)
    assert "<think>\ngreet back\n</think>\n\nHello!" in kept
    # after the last user message (a tool loop), the Qwen3-style template shows it
    loop = tok.render_chat(msgs[:2], add_generation_prompt=False, chat_template=QWEN3_STYLE)
    assert "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello!" in loop


def test_the_rewarmed_prefix_is_exactly_how_the_next_prompt_starts():
    """next_prompt_prefix renders the chat as the template will once a user message follows: with a
    Qwen3-style template the last reply loses its thinking there, and the prefix ids are the next
    prompt's first ids (cut at the end-of-turn token, a hard tokenization boundary)."""
    from chatserve.config import default_model_path
    from chatserve.text.tokenizer import Tokenizer
    base = Tokenizer.from_model(default_model_path())
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4.", "reasoning_content": "two and two make four"}]
    nxt = [*chat, {"role": "user", "content": "And 3+3?"}]
    for template, shows_thinking in ((QWEN3_STYLE, False), (KEEPS_THINKING, True)):
        tok = base.with_chat_template(template)
        prefix = next_prompt_prefix(tok, chat)
        prompt = tok.apply_chat_template(nxt)
        assert prefix and prompt[:len(prefix)] == prefix and len(prompt) > len(prefix)
        assert prefix[-1] == tok.end_of_turn_id
        text = tok.decode(prefix, skip_special_tokens=False)
        assert text.endswith("It is 4.<|im_end|>") and ("two and two" in text) == shows_thinking
        # what the reply's own turn left in the cache: its prompt + the thinking + the answer
        sampled = tok.apply_chat_template(chat[:2]) + tok.encode("<think>\ntwo and two make four\n</think>\n\nIt is 4.")
        common = common_prefix_len(sampled, prompt)
        assert common == (len(sampled) if shows_thinking else len(tok.apply_chat_template(chat[:2])))
