"""The web UI in headless Chromium: streaming with stats, Stop, hostile output, reload, identities.

The model is replaced by a scripted backend through the documented hook
`sessions.install(..., backend=...)` (see docs/sessions.md), so a test decides exactly what the "model" says.
"""
from __future__ import annotations

import re
import time
from typing import Any

import pytest

from browser_support import LiveServer
from session_fakes import ScriptedChat, make_app

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]


def open_ui(page, srv: LiveServer, suffix: str = "/") -> None:
    page.goto(srv.url + suffix)
    page.wait_for_selector("body[data-ready='1']", timeout=10_000)


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.keyboard.press("Enter")


def kv_usage(page, srv: LiveServer) -> float:
    text = page.request.get(srv.url + "/metrics").text()
    vals = [float(m.group(1)) for m in re.finditer(r"^chatserve:kv_cache_usage_perc(?:\{[^}]*\})?\s+(\S+)$",
                                                   text, re.M)]
    assert vals, "no chatserve:kv_cache_usage_perc in /metrics"
    return max(vals)


def wait_js(page, expr: str, timeout: int = 10_000) -> Any:
    """page.wait_for_function evaluates strings with eval(), which our CSP forbids: poll instead."""
    return wait_until(lambda: page.evaluate(expr), timeout / 1000)


STREAMING_TEXT = """(() => {
  const m = [...document.querySelectorAll('.msg.assistant')].pop();
  return m && m.classList.contains('streaming') ? m.querySelector('.msg-body').innerText : null;
})()"""


def visible_while_streaming(page, min_chars: int = 1, timeout: float = 15.0) -> str:
    """Text of the last reply bubble read while it is still streaming (one evaluate, so the two agree)."""
    return wait_until(lambda: (t := page.evaluate(STREAMING_TEXT)) and len(t.strip()) >= min_chars and t, timeout)


def wait_until(fn, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_message_streams_an_answer_with_stats(live, chat, page, transport):
    srv, _ = live
    chat.reply = lambda m: "The answer is **forty-two**, " + "and it streams word by word " * 30
    chat.delay_s = 0.02
    open_ui(page, srv, "/?transport=sse" if transport == "sse" else "/")
    send(page, "What is the answer?")
    partial = visible_while_streaming(page, min_chars=len("The answer is forty-two"))
    assert partial.startswith("The answer is forty-two")                 # text shows while it streams
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=30_000)
    final = page.inner_text(".msg.assistant .msg-body")
    assert len(partial) < len(final) and final.startswith(partial.strip())
    assert page.inner_text(".msg.assistant strong") == "forty-two"          # markdown rendered
    stats = page.inner_text(".msg.assistant .stats")
    assert "TTFT 12 ms" in stats and "42.0 tok/s" in stats and re.search(r"prompt \d+ \(cached \d+\)", stats)
    assert page.evaluate("document.body.dataset.transport") == transport
    assert page.inner_text(".msg.user .msg-body") == "What is the answer?"
    assert "What is the answer?" in page.inner_text("#session-list")
    assert re.search(r"\d+ tokens", page.inner_text("#context-text"))
    # a second turn: the prefix of the first is reported cached
    send(page, "And again?")
    page.wait_for_selector(".msg.assistant >> nth=1", timeout=10_000)
    wait_js(page, "document.querySelectorAll('.msg.assistant .stat-ttft').length == 2", timeout=15_000)
    second = page.inner_text(".msg.assistant >> nth=1 >> .stats")
    assert not re.search(r"cached 0\)", second)
    assert not page.errors


def test_stop_cancels_the_generation_on_the_server(live, chat, page):
    srv, _ = live
    chat.reply = lambda m: "tick " * 2000
    chat.delay_s = 0.01
    open_ui(page, srv)
    send(page, "count forever")
    page.wait_for_selector(".msg.assistant.streaming", timeout=10_000)
    wait_until(lambda: kv_usage(page, srv) > 0)
    aborted = chat.aborted
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat.stopped", timeout=10_000)
    assert wait_until(lambda: kv_usage(page, srv) == 0) is True
    assert chat.aborted == aborted + 1 and chat.active == 0
    words = page.inner_text(".msg.assistant .msg-body").split()
    assert 0 < len(words) < 2000                                             # the partial reply is kept
    assert page.is_visible("#send") and not page.is_visible("#stop")
    # the stored turn says it was stopped, and a reload shows it the same way
    page.reload()
    page.wait_for_selector(".msg.assistant .stat.stopped", timeout=10_000)


def test_model_output_cannot_run_script(live, chat, page):
    srv, _ = live
    hostile = (
        'Look: <img src="x" onerror="window.__pwned = 1"> and <script>window.__pwned = 2</script>\n\n'
        '[click me](javascript:window.__pwned=3) <a href="javascript:window.__pwned=4" id="evil">evil</a>\n\n'
        '<svg><g onload="window.__pwned=5"></g></svg><iframe src="javascript:window.__pwned=6"></iframe>\n\n'
        '<details open ontoggle="window.__pwned=7">x</details> <form action="javascript:window.__pwned=8">'
        '<button>go</button></form>\n\n![pixel](https://attacker.example/leak.png)\n\n'
        '```html\n<script>window.__pwned = 9</script>\n```\n'
    )
    chat.reply = lambda m: hostile
    blocked_requests: list[str] = []
    page.on("request", lambda r: blocked_requests.append(r.url) if "attacker.example" in r.url else None)
    open_ui(page, srv)
    send(page, "say something nasty")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=15_000)
    body = page.locator(".msg.assistant .msg-body")
    for link in body.locator("a").all():
        link.click(modifiers=["Control"]) if link.get_attribute("href") else link.click()
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned") is None
    html = body.inner_html()
    assert "onerror" not in html and "ontoggle" not in html and "onload" not in html
    assert body.locator("script, iframe, form, button:not(.code-copy)").count() == 0
    assert all(not (a.get_attribute("href") or "").lower().startswith("javascript:")
               for a in body.locator("a").all())
    assert "window.__pwned = 9" in body.locator("pre code").inner_text()      # shown as code, not run
    assert blocked_requests == []                                            # CSP: no remote images
    # no page error; the CSP may report handlers it refused in DOMPurify's inert parsing document
    assert [e for e in page.errors if "Content Security Policy" not in e] == []


def test_reload_restores_the_conversation_from_the_server(live, chat, page):
    srv, _ = live
    open_ui(page, srv)
    send(page, "first message")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
    send(page, "second message")
    wait_js(page, "document.querySelectorAll('.msg.assistant .stat-ttft').length == 2", timeout=10_000)
    sid = page.evaluate("location.hash.slice(1)")
    assert len(sid) >= 22
    page.reload()
    page.wait_for_selector(".msg.assistant >> nth=1", timeout=10_000)
    texts = page.locator(".msg .msg-body").all_inner_texts()
    assert texts == ["first message", "echo: first message", "second message", "echo: second message"]
    assert "TTFT" in page.inner_text(".msg.assistant >> nth=1 >> .stats")
    # a fresh tab of the same browser (same cookie, no hash) lists it too
    other = page.context.new_page()
    open_ui(other, srv)
    other.click(f".session-item[data-id='{sid}'] .session-title")
    other.wait_for_selector(".msg.assistant >> nth=1", timeout=10_000)
    other.close()


def test_second_browser_identity_sees_nothing(live, chat, browser, page):
    srv, _ = live
    open_ui(page, srv)
    send(page, "a private thought")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
    sid = page.evaluate("location.hash.slice(1)")
    cookie = {c["name"]: c for c in page.context.cookies()}["chatserve_uid"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax" and len(cookie["value"]) >= 32
    assert page.evaluate("document.cookie") == ""                           # HttpOnly: not readable
    ctx2 = browser.new_context()
    try:
        p2 = ctx2.new_page()
        open_ui(p2, srv, f"/#{sid}")
        assert p2.locator(".session-item").count() == 0
        assert p2.locator(".msg").count() == 0
        assert p2.request.get(f"{srv.url}/v1/sessions/{sid}").status == 404
        assert p2.request.get(f"{srv.url}/v1/sessions").json()["data"] == []
        assert {c["name"]: c for c in ctx2.cookies()}["chatserve_uid"]["value"] != cookie["value"]
    finally:
        ctx2.close()


def numbered_replies(chat: ScriptedChat) -> None:
    """The scripted model answers "reply #N to <last message>", counting from 1."""
    n = {"i": 0}

    def reply(m: list[dict]) -> str:
        n["i"] += 1
        return f"reply #{n['i']} to {m[-1]['content']}"
    chat.reply = reply


def first_numbered_reply(page, srv: LiveServer, chat: ScriptedChat) -> None:
    """Numbered replies; the UI open, "hello" sent and its reply ("reply #1 to hello") finished."""
    numbered_replies(chat)
    open_ui(page, srv)
    send(page, "hello")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)


def test_regenerate_edit_rename_delete(live, chat, page):
    srv, _ = live
    first_numbered_reply(page, srv, chat)
    page.click(".msg.assistant .regenerate")
    wait_js(page, "document.querySelector('.msg.assistant .msg-body').innerText.startsWith('reply #2')",
                           timeout=10_000)
    assert page.locator(".msg").count() == 2
    page.click(".msg.user .edit")
    page.fill(".msg.user .edit-box", "hello, edited")
    page.click(".msg.user .edit-send")
    wait_js(page, "document.querySelector('.msg.assistant .msg-body').innerText.includes('hello, edited')",
                           timeout=10_000)
    assert page.locator(".msg .msg-body").all_inner_texts()[0] == "hello, edited"
    sid = page.evaluate("location.hash.slice(1)")
    item = f".session-item[data-id='{sid}']"
    page.click(f"{item} .rename")
    page.fill(".rename-input", "Renamed chat")
    page.keyboard.press("Enter")
    page.wait_for_selector(f"{item} .session-title:has-text('Renamed chat')", timeout=10_000)
    page.click(f"{item} .delete")
    page.click(f"{item} .delete")                                           # second click confirms
    page.wait_for_selector(item, state="detached", timeout=10_000)
    assert page.request.get(f"{srv.url}/v1/sessions/{sid}").status == 404


def test_settings_theme_phone_layout_and_autoscroll(live, chat, browser):
    srv, _ = live
    ctx = browser.new_context(viewport={"width": 390, "height": 760}, is_mobile=True, has_touch=True)
    page = ctx.new_page()
    try:
        open_ui(page, srv)
        # phone: the list is a drawer
        assert not page.is_visible("#new-chat") or page.evaluate(
            "document.getElementById('sidebar').getBoundingClientRect().right <= 0")
        page.click("#open-sidebar")
        wait_js(page, "document.getElementById('sidebar').getBoundingClientRect().left >= 0")
        page.click("#scrim", position={"x": 375, "y": 400})
        # settings are stored with the session and sent with the turn
        page.click("#toggle-settings")
        page.fill("#system-prompt", "You are terse.")
        page.fill("#p-temperature", "0.3")
        page.fill("#p-max_tokens", "4000")
        page.click("#save-settings")
        wait_js(page, "location.hash.length > 10")
        chat.reply = lambda m: "\n\n".join(f"line {i}" for i in range(300))
        chat.delay_s = 0.004
        page.click("#toggle-settings")
        send(page, "long please")
        wait_js(page, "document.querySelector('.msg.assistant.streaming') && "
                               "document.getElementById('messages').scrollHeight > 2000", timeout=15_000)
        req = chat.requests[-1]["req"]
        assert req["messages"][0] == {"role": "system", "content": "You are terse."}
        assert req["temperature"] == 0.3 and req["max_tokens"] == 4000
        # the user scrolls up: autoscroll pauses and stays paused while the reply grows
        page.evaluate("document.getElementById('messages').scrollBy(0, -1200)")
        page.wait_for_timeout(100)
        top = page.evaluate("document.getElementById('messages').scrollTop")
        page.wait_for_timeout(300)
        assert abs(page.evaluate("document.getElementById('messages').scrollTop") - top) < 5
        assert page.is_visible("#jump-bottom")
        page.wait_for_selector(".msg.assistant:not(.streaming)", timeout=20_000)
        # dark mode
        before = page.evaluate("document.documentElement.dataset.theme")
        page.click("#open-sidebar")
        page.click("#theme-toggle")
        assert page.evaluate("document.documentElement.dataset.theme") != before
        assert page.evaluate("document.getElementById('hljs-dark').disabled") == (before == "dark")
    finally:
        ctx.close()


def test_api_key_server_asks_for_a_key_and_keys_own_sessions(browser):
    chat = ScriptedChat()
    with LiveServer(make_app(chat, api_keys=("k-alpha", "k-beta"))) as srv:
        ctx = browser.new_context()
        try:
            page = ctx.new_page()
            open_ui(page, srv)
            page.wait_for_selector("#key-form", state="visible")
            page.fill("#api-key", "wrong")
            page.press("#api-key", "Enter")
            page.wait_for_selector("#api-key[aria-invalid='true']")
            page.fill("#api-key", "k-alpha")
            page.press("#api-key", "Enter")
            page.wait_for_selector("#key-form", state="hidden")
            send(page, "keyed hello")
            page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
            assert page.evaluate("document.body.dataset.transport") == "websocket"   # key as subprotocol
            assert chat.requests[-1]["owner"].startswith("key:")
            page.reload()                                   # the key is kept for this tab
            page.wait_for_selector(".msg.assistant", timeout=10_000)
            h = {"authorization": "Bearer k-beta"}
            assert page.request.get(f"{srv.url}/v1/sessions", headers=h).json()["data"] == []
            h = {"authorization": "Bearer k-alpha"}
            assert len(page.request.get(f"{srv.url}/v1/sessions", headers=h).json()["data"]) == 1
        finally:
            ctx.close()


def test_store_outage_notice_and_export_import(browser, redis_server, tmp_path):
    from chatserve.server.sessions import RedisSessionStore
    chat = ScriptedChat()
    store = RedisSessionStore(redis_server.url, op_timeout_s=0.3, retry_interval_s=0.1)
    with LiveServer(make_app(chat, store=store)) as srv:
        ctx = browser.new_context(accept_downloads=True)
        try:
            page = ctx.new_page()
            open_ui(page, srv)
            assert page.is_hidden("#notice")
            send(page, "before the outage")
            page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
            redis_server.stop()
            send(page, "during the outage")
            page.wait_for_selector(".msg.assistant >> nth=1 >> .stat-ttft", timeout=10_000)
            page.wait_for_selector("#notice.warn:has-text('unreachable')", timeout=10_000)
            redis_server.start()
            page.wait_for_selector("#notice", state="hidden", timeout=15_000)
            # export through the button, import the file back as a new conversation
            with page.expect_download() as dl:
                page.click("#export-chat")
            path = tmp_path / "chat.json"
            dl.value.save_as(path)
            page.set_input_files("#import-file", str(path))
            wait_js(page, "document.querySelectorAll('.session-item').length == 2")
            sid_new = page.evaluate("location.hash.slice(1)")
            texts = page.locator(".msg .msg-body").all_inner_texts()
            assert texts[0] == "before the outage" and texts[2] == "during the outage" and len(texts) == 4
            assert len(sid_new) >= 22
        finally:
            ctx.close()
