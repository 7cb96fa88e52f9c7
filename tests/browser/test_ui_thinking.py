"""A reasoning model's thinking in the web UI (headless Chromium): a collapsible block that streams live
from delta.reasoning_content, folds when the answer starts and says how long it took, stays folded after
a reload, and a per-chat thinking switch that sends reasoning_effort "none" when off.

The model is the scripted session backend (session_fakes.ScriptedChat with `think`), served with a model
card whose chat template has a thinking switch.
"""
from __future__ import annotations

import re
import threading
from typing import Iterator

import pytest

from browser_support import LiveServer
from session_fakes import ScriptedChat, make_app
from test_ui_chat import open_ui, send, wait_js, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

CARD = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "chatserve", "max_model_len": 4096,
        "sampling_defaults": {}, "thinking_switch": True}
THOUGHT = "First I recall that **Paris** is the capital. <img src=x onerror=\"window.pwned=1\"> Then I check it."


@pytest.fixture(scope="module")
def thinking_live() -> Iterator[tuple[LiveServer, ScriptedChat]]:
    chat = ScriptedChat(reply=lambda m: "The capital of France is Paris.")
    with LiveServer(make_app(chat, model_card=CARD)) as srv:
        yield srv, chat


def block_state(page) -> dict | None:
    return page.evaluate("""(() => {
      const m = [...document.querySelectorAll('.msg.assistant')].pop();
      const d = m && m.querySelector('details.thinking');
      if (!d || d.hidden) return null;
      return {open: d.open, live: d.classList.contains('live'), summary: d.querySelector('summary').innerText,
              text: d.querySelector('.thinking-body').textContent, answer: m.querySelector('.msg-body').innerText,
              streaming: m.classList.contains('streaming')};
    })()""")


def test_thinking_streams_live_folds_with_its_time_and_stays_folded(thinking_live, page):
    srv, chat = thinking_live
    gate = threading.Event()
    chat.think, chat.think_gate, chat.delay_s = (lambda m: THOUGHT), gate, 0.02
    try:
        open_ui(page, srv)
        send(page, "What is the capital of France?")
        # while it thinks: the block is open, live, and its text grows before any answer exists
        first = wait_until(lambda: (b := block_state(page)) and b["streaming"] and b["text"].strip() and b)
        assert first["open"] and first["live"] and first["summary"] == "Thinking…" and first["answer"] == ""
        full = wait_until(lambda: (b := block_state(page)) and b["text"].strip().endswith("Then I check it.") and b)
        assert full["text"].startswith(first["text"].strip()) and full["open"] and full["live"]
        assert full["answer"] == "" and full["streaming"]            # the answer is held back: still thinking
        assert page.inner_text(".msg.assistant details.thinking strong") == "Paris"     # markdown, sanitized
        gate.set()                                                 # the answer starts: the block folds
        done = wait_until(lambda: (b := block_state(page)) and not b["streaming"] and b)
        assert not done["open"] and not done["live"]
        assert re.fullmatch(r"Thought for \d+(\.\d)? s", done["summary"]), done["summary"]
        assert done["answer"] == "The capital of France is Paris." and "Paris" not in done["summary"]
        assert page.evaluate("window.pwned") is None
        assert page.locator(".msg.assistant details.thinking img[onerror]").count() == 0
        # a reload: the stored reasoning comes back, folded, with the server's recorded time
        page.reload()
        page.wait_for_selector("body[data-ready='1']")
        again = wait_until(lambda: block_state(page))
        assert not again["open"] and again["text"].startswith("First I recall that Paris")
        assert re.fullmatch(r"Thought for \d+(\.\d)? s", again["summary"]), again["summary"]
        page.click(".msg.assistant details.thinking summary")      # the user may unfold it
        assert wait_until(lambda: block_state(page)["open"])
        # no page error; the CSP may report the handler it refused in DOMPurify's inert parsing document
        assert [e for e in page.errors if "Content Security Policy" not in e] == []
    finally:
        chat.think, chat.think_gate, chat.delay_s = None, None, 0.0


def test_the_thinking_switch_is_per_chat_and_sends_reasoning_effort(thinking_live, page):
    srv, chat = thinking_live
    chat.think = lambda m: "short thought"
    open_ui(page, srv)
    btn = page.locator("#thinking-toggle")
    assert btn.is_visible() and btn.get_attribute("aria-pressed") == "true"
    btn.click()                                                   # off before the chat exists
    assert btn.get_attribute("aria-pressed") == "false" and btn.inner_text() == "Thinking: off"
    send(page, "no thinking please")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=20_000)
    assert chat.requests[-1]["req"]["reasoning_effort"] == "none"
    sid = page.evaluate("location.hash.slice(1)")
    assert page.request.get(f"{srv.url}/v1/sessions/{sid}").json()["params"]["reasoning_effort"] == "none"
    btn.click()                                                   # on again for this chat
    assert btn.get_attribute("aria-pressed") == "true"            # at once, before the save returns
    wait_until(lambda: "reasoning_effort" not in page.request.get(f"{srv.url}/v1/sessions/{sid}").json()["params"])
    assert btn.get_attribute("aria-pressed") == "true"            # and still after it
    send(page, "now think")
    wait_js(page, "document.querySelectorAll('.msg.assistant:not(.streaming) .stat-ttft').length == 2", 20_000)
    assert "reasoning_effort" not in chat.requests[-1]["req"]
    # another chat starts with thinking on; the first one keeps its own switch after a reload
    page.click("#new-chat")
    assert btn.get_attribute("aria-pressed") == "true"
    page.goto(f"{srv.url}/#{sid}")
    page.wait_for_selector("body[data-ready='1']")
    page.wait_for_selector(".msg.assistant >> nth=1")
    assert btn.get_attribute("aria-pressed") == "true"
    assert not page.errors
    chat.think = None
