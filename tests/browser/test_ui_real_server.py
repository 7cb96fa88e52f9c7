"""The UI against the real `chatserve serve` (tiny random model, real engine, real Redis, real browser):
streaming with the engine's stats, Stop freeing the KV cache, and a server restart losing nothing."""
from __future__ import annotations

import re

import pytest

from browser_support import ServeProcess
from test_ui_chat import kv_usage, open_ui, send, visible_while_streaming, wait_js, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(180)]

# KaTeX loads on first use and typesets math after the markdown is on screen: compare settled pages
MATH_SETTLED = "!document.querySelector('.msg-body .math[data-tex]:not([data-done])')"


@pytest.fixture(scope="module")
def paced_model(tmp_path_factory) -> str:
    """A tiny model with 12 wider layers and an 8k context: it streams a few hundred tokens/s here,
    nearer a real model's pace. The default tiny model streams ~1,000/s, and a 1,500-token reply could
    end before the test's stop click lands; a 6,000-token one at this pace lasts ~25 s."""
    from chatserve.runtime.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("paced") / "m", hidden_size=256, intermediate_size=768,
                           num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=8192)


def test_real_server_stream_stop_and_restart(browser, redis_server, paced_model, tmp_path):
    log = tmp_path / "serve.log"
    args = ("--kv-blocks", "512", "--redis-url", redis_server.url)
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    page = ctx.new_page()
    try:
        with ServeProcess(paced_model, log, *args) as srv:
            open_ui(page, srv)
            assert page.is_hidden("#notice")                       # Redis configured and healthy
            page.click("#toggle-settings")
            page.fill("#p-max_tokens", "6000")
            page.fill("#p-temperature", "1")
            page.click("#save-settings")
            page.wait_for_selector("#save-settings:has-text('Saved')")
            wait_js(page, "location.hash.length > 10")
            page.click("#toggle-settings")
            send(page, "Tell me a long story")
            page.wait_for_selector(".msg.assistant.streaming", timeout=20_000)
            wait_until(lambda: kv_usage(page, srv) > 0, 20)
            visible_while_streaming(page, min_chars=1, timeout=60)   # tokens on screen while it streams
            page.click("#stop")
            page.wait_for_selector(".msg.assistant:not(.streaming) .stat.stopped", timeout=20_000)
            assert wait_until(lambda: kv_usage(page, srv) == 0, 10) is True
            # a short second turn: the engine's usage, with the first turn's prefix cached
            page.click("#toggle-settings")
            page.fill("#p-max_tokens", "6")
            page.click("#save-settings")
            sid = page.evaluate("location.hash.slice(1)")
            wait_until(lambda: page.request.get(f"{srv.url}/v1/sessions/{sid}").json()["params"]
                       .get("max_tokens") == 6)                     # the PATCH landed
            page.click("#toggle-settings")
            send(page, "Shorter, please")
            wait_js(page, "document.querySelectorAll('.msg.assistant:not(.streaming) .stat-ttft').length == 2",
                    timeout=30_000)
            stats = page.inner_text(".msg.assistant >> nth=1 >> .stats")
            m = re.search(r"prompt (\d+) \(cached (\d+)\)", stats)
            assert m and int(m.group(2)) > 0 and int(m.group(1)) > int(m.group(2)), stats
            assert "tok/s" in stats and "6 tokens" in stats
            wait_js(page, MATH_SETTLED)
            before = page.locator(".msg .msg-body").all_inner_texts()
        with ServeProcess(paced_model, log, *args) as srv2:         # a new process, the same Redis
            sid = page.evaluate("location.hash.slice(1)")
            page.goto(f"{srv2.url}/#{sid}")
            page.wait_for_selector("body[data-ready='1']")
            page.wait_for_selector(".msg.assistant >> nth=1", timeout=10_000)
            wait_js(page, MATH_SETTLED)
            assert page.locator(".msg .msg-body").all_inner_texts() == before   # what Redis kept
            assert page.locator(".stat.stopped").count() == 1
    finally:
        ctx.close()
