"""The thinking block against the real `chatserve serve` (engine, reasoning parser and chat template of
a tiny Qwen3 checkpoint whose output is scripted: tests/reasoning/think_models.py): the model's
`<think>` block arrives as delta.reasoning_content and shows folded above the answer, survives a
reload, and the chat's thinking switch turns it off through the template's enable_thinking."""
from __future__ import annotations

import os
import re
import sys

import pytest

from browser_support import ServeProcess
from test_ui_chat import open_ui, send, wait_js
from test_ui_thinking import block_state

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "reasoning"))
import think_models  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]
DONE = "document.querySelectorAll('.msg.assistant:not(.streaming) .stat-ttft').length == {n}"


def test_real_reasoning_model_thinking_block_and_switch(browser, tmp_path):
    thought, answer = "".join(think_models.THOUGHT), "".join(think_models.ANSWER)
    model = think_models.build(tmp_path / "ckpt", "qwen3", think_models.qwen3_chains())
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        with ServeProcess(str(model), tmp_path / "serve.log", "--max-model-len", "1024", "--kv-blocks", "128") as srv:
            open_ui(page, srv)
            btn = page.locator("#thinking-toggle")
            assert btn.is_visible() and btn.get_attribute("aria-pressed") == "true"   # the template has a switch
            send(page, "hi")
            wait_js(page, DONE.format(n=1), timeout=60_000)
            b = block_state(page)
            assert b and b["text"].strip() == thought and not b["open"] and b["answer"].strip() == answer
            assert re.fullmatch(r"Thought for \d+(\.\d)? s", b["summary"])
            assert "<think>" not in page.inner_text("#messages")
            page.reload()
            page.wait_for_selector("body[data-ready='1']")
            page.wait_for_selector(".msg.assistant details.thinking")
            again = block_state(page)
            assert again["text"].strip() == thought and not again["open"]
            btn.click()                                              # thinking off for this chat
            wait_js(page, "document.getElementById('thinking-toggle').getAttribute('aria-pressed') == 'false'")
            send(page, "hi")
            wait_js(page, DONE.format(n=2), timeout=60_000)
            assert block_state(page) is None                         # no thinking, straight to the answer
            assert page.inner_text(".msg.assistant >> nth=1 >> .msg-body").strip() == answer
            assert errors == []
    finally:
        ctx.close()
