"""The UI's streams in Chromium: the SSE parser (LF, CRLF, CR, [DONE], in-stream errors), WebSocket
retried after a failed open, several chats streaming at once with their own Stop, and a server that dies
mid-reply (offline indicator, reconnect with backoff, the composer keeps unsent text, no stuck bubble)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from browser_support import LiveServer
from session_fakes import ScriptedChat, make_app
from test_ui_chat import first_numbered_reply, open_ui, send, visible_while_streaming, wait_js, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


PARSE = """async ([body, step]) => {
  const { SSEParser } = await import('/static/js/sse.js');
  const p = new SSEParser();
  const out = [];
  for (let i = 0; i < body.length; i += step) out.push(...p.push(body.slice(i, i + step)));
  return out.map((e) => [e.event, e.data]);
}"""


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_sse_parser_follows_the_spec_for_every_line_ending(live, page, eol):
    srv, _ = live
    open_ui(page, srv)
    events = ['data: {"n": 1}', ": keep-alive", 'data:{"n": 2}', "event: error\ndata: {\"error\": {}}",
              "data: a\ndata: b", "data: [DONE]"]
    body = "".join(e.replace("\n", eol) + eol + eol for e in events)
    want = [["message", '{"n": 1}'], ["message", '{"n": 2}'], ["error", '{"error": {}}'], ["message", "a\nb"],
            ["message", "[DONE]"]]
    for step in (1, 2, 5, len(body)):               # a CR and its LF may arrive in different reads
        assert page.evaluate(PARSE, [body, step]) == want, step


def reframe(body: str, eol: str, error: str | None = None) -> str:
    """The server's SSE body with its events re-framed with `eol`, a keep-alive comment added, and
    optionally the end replaced by an in-stream error event."""
    events = [e for e in body.replace("\r\n", "\n").split("\n\n") if e.strip()]
    out = [e.replace("\n", eol) for e in events if e != "data: [DONE]"]
    if error:
        out = out[:3] + ["data: " + json.dumps({"error": {"message": error, "code": "generation_failed"}})]
    else:
        out = out[:2] + [": ping"] + out[2:] + ["data: [DONE]"]
    return "".join(e + eol + eol for e in out)


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_sse_replies_in_any_framing_and_in_stream_errors(live, chat, page, eol):
    srv, _ = live
    chat.reply = lambda m: "Hello there, friend"
    errors = [None, "the model fell over"]

    def handle(route):
        r = route.fetch()                               # the real turn, stored by the server
        route.fulfill(status=200, headers={"content-type": "text/event-stream"},
                      body=reframe(r.text(), eol, errors.pop(0)))
    page.route("**/v1/sessions/*/messages", handle)
    open_ui(page, srv, "/?transport=sse")
    send(page, "hi")
    page.wait_for_selector(".msg.assistant:not(.streaming)", timeout=10_000)
    assert page.inner_text(".msg.assistant .msg-body") == "Hello there, friend"
    assert page.locator(".error-item").count() == 0
    send(page, "again")
    page.wait_for_selector(".error-item:has-text('the model fell over')", timeout=10_000)
    assert page.locator(".msg.streaming").count() == 0


BREAK_WS = """(() => {
  const Real = window.WebSocket;
  window.__wsFail = true;
  window.WebSocket = function (url, protocols) {
    if (window.__wsFail) throw new DOMException('blocked by the test', 'SecurityError');
    return new Real(url, protocols);
  };
  Object.assign(window.WebSocket, { OPEN: 1, CLOSED: 3, CONNECTING: 0, CLOSING: 2 });
})();"""


def test_sse_fallback_streams_and_websocket_is_tried_again_later(live, chat, page):
    srv, _ = live
    page.add_init_script(BREAK_WS)
    chat.reply = lambda m: "streaming over the fallback " * 40
    chat.delay_s = 0.02
    open_ui(page, srv)
    send(page, "first")
    assert visible_while_streaming(page, min_chars=20).startswith("streaming over the fallback")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=30_000)
    assert page.evaluate("document.body.dataset.transport") == "sse"
    page.evaluate("window.__wsFail = false")                     # the network heals
    page.wait_for_timeout(2500)                                  # the first retry is 2 s after a failure
    chat.reply = lambda m: "back on the socket"
    send(page, "second")
    wait_js(page, "document.querySelectorAll('.msg.assistant:not(.streaming) .stat-ttft').length == 2", 15_000)
    assert page.evaluate("document.body.dataset.transport") == "websocket"
    assert not page.errors


def test_chats_stream_at_once_and_stop_only_their_own(live, chat, page):
    srv, _ = live
    chat.reply = lambda m: ("slow " * 600) if "slow" in m[-1]["content"] else "quick answer"
    chat.delay_s = 0.03
    open_ui(page, srv)
    send(page, "slow one")
    visible_while_streaming(page, min_chars=10)
    sid_a = page.evaluate("location.hash.slice(1)")
    assert page.is_visible("#stop")
    # Enter while this chat is busy is not silently dropped: a hint, and the text stays
    send(page, "too soon")
    page.wait_for_selector("#hint:has-text('Esc')")
    assert page.input_value("#input") == "too soon"
    # New chat works while A streams; B has its own idle state and its own turn
    page.click("#new-chat")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    page.fill("#input", "")
    send(page, "fast one")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=20_000)
    sid_b = page.evaluate("location.hash.slice(1)")
    assert sid_b != sid_a and page.inner_text(".msg.assistant .msg-body") == "quick answer"
    page.wait_for_selector(f".session-item[data-id='{sid_b}']")
    assert page.locator(f".session-item.live[data-id='{sid_a}']").count() == 1   # A still streams
    # back to A: still streaming, and Esc stops A
    page.click(f".session-item[data-id='{sid_a}'] .session-title")
    before = len(visible_while_streaming(page, min_chars=10))
    assert page.is_visible("#stop")
    wait_until(lambda: len(page.evaluate("document.querySelector('.msg.assistant:last-of-type .msg-body').innerText")) > before)
    page.keyboard.press("Escape")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat.stopped", timeout=15_000)
    assert page.is_visible("#send")
    b = page.request.get(f"{srv.url}/v1/sessions/{sid_b}").json()["messages"][-1]
    assert b["content"] == "quick answer" and b["finish_reason"] == "stop"          # B was never cancelled
    assert not page.errors


def test_server_dies_mid_reply_and_comes_back(browser, redis_server):
    from chatserve.server.sessions import RedisSessionStore
    chat = ScriptedChat(reply=lambda m: "a long reply that will be cut " * 200, delay_s=0.03)
    srv = LiveServer(make_app(chat, store=RedisSessionStore(redis_server.url))).__enter__()
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        open_ui(page, srv)
        send(page, "tell me everything")
        visible_while_streaming(page, min_chars=20)
        srv.kill()                                                # the server is gone mid-reply
        page.wait_for_selector(".msg.assistant:not(.streaming)", timeout=20_000)   # never stuck "streaming"
        page.wait_for_selector("#conn:has-text('Offline')", timeout=20_000)
        assert page.locator(".msg.streaming").count() == 0
        # typed while the server is down: refused visibly, kept in the box
        page.fill("#input", "typed while down")
        page.keyboard.press("Enter")
        page.wait_for_selector(".error-item:has-text('unreachable')")
        assert page.input_value("#input") == "typed while down"
        first_errors = page.locator(".error-item").all_inner_texts()
        # a new server process on the same port and the same Redis
        srv = LiveServer(make_app(chat, store=RedisSessionStore(redis_server.url)), port=srv.port).__enter__()
        page.wait_for_selector("#conn", state="hidden", timeout=60_000)   # reconnected by itself
        assert page.locator(".error-item").all_inner_texts()[:len(first_errors)] == first_errors  # not overwritten
        chat.reply = lambda m: "welcome back"
        chat.delay_s = 0.0
        page.keyboard.press("Enter")
        wait_js(page, "[...document.querySelectorAll('.msg.assistant .msg-body')].pop().innerText == 'welcome back'",
                20_000)
        assert page.input_value("#input") == ""                  # cleared once the server took it
    finally:
        ctx.close()
        srv.__exit__()


FULL = " ".join(f"w{i}" for i in range(500))


@pytest.mark.parametrize("transport", ["websocket", "sse"])
def test_reload_and_a_dropped_connection_reattach_to_the_running_reply(live, chat, page, transport):
    srv, _ = live
    chat.reply = lambda m: FULL
    chat.delay_s = 0.02                                            # ~10 s of reply
    sockets: list[Any] = []

    def proxy(ws):                                                 # a pass-through the test can cut
        ws.connect_to_server()
        sockets.append(ws)
    page.route_web_socket("**/v1/ws", proxy)
    attaches: list[str] = []
    page.on("request", lambda r: attaches.append(r.url) if r.url.endswith("/attach") else None)
    suffix = "/?transport=sse" if transport == "sse" else "/"
    open_ui(page, srv, suffix)
    send(page, "a long one")
    before = visible_while_streaming(page, min_chars=30)
    page.reload()                                                  # the server keeps generating
    page.wait_for_selector("body[data-ready='1']")
    after = visible_while_streaming(page, min_chars=len(before) + 10)
    assert after.startswith("w0 w1 w2") and FULL.startswith(after.strip())   # replayed once, then live
    if transport == "sse":
        assert len(attaches) == 1
    else:
        sockets[-1].close(code=4000, reason="cut by the test")     # the connection drops mid-reply
        page.wait_for_selector("#conn:has-text('Offline')", timeout=10_000)
        page.wait_for_selector("#conn", state="hidden", timeout=30_000)
        again = visible_while_streaming(page, min_chars=len(after) + 10)
        assert FULL.startswith(again.strip())
        assert len(sockets) == 3                                   # first page, reload, reconnect
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=30_000)
    assert page.inner_text(".msg.assistant .msg-body") == FULL     # nothing lost, nothing doubled
    assert chat.requests[-1]["req"]["messages"][-1]["content"] == "a long one"
    assert page.locator(".error-item").count() == 0
    assert not page.errors


def test_branches_keep_every_version(live, chat, page):
    srv, _ = live
    first_numbered_reply(page, srv, chat)
    send(page, "more")
    wait_js(page, "document.querySelectorAll('.msg.assistant:not(.streaming) .stat-ttft').length == 2")
    page.click(".msg.assistant >> nth=1 >> .regenerate")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .pager-text:has-text('2/2')", timeout=10_000)
    assert page.inner_text(".msg.assistant >> nth=1 >> .msg-body") == "reply #3 to more"
    page.click(".msg.assistant >> nth=1 >> .prev")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .pager-text:has-text('1/2')")
    assert page.inner_text(".msg.assistant >> nth=1 >> .msg-body") == "reply #2 to more"
    # editing the first message keeps the old conversation as version 1 of it
    page.click(".msg.user >> nth=0 >> .edit")
    page.fill(".edit-box", "hello again")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.user >> nth=0 >> .pager-text:has-text('2/2')", timeout=10_000)
    assert page.locator(".msg").count() == 2
    assert page.inner_text(".msg.assistant .msg-body") == "reply #4 to hello again"
    page.click(".msg.user >> nth=0 >> .prev")
    page.wait_for_selector(".msg.user >> nth=0 >> .pager-text:has-text('1/2')")
    texts = page.locator(".msg .msg-body").all_inner_texts()
    assert texts == ["hello", "reply #1 to hello", "more", "reply #2 to more"]    # nothing was deleted
    page.reload()                                                  # stored on the server
    page.wait_for_selector(".msg.user >> nth=0 >> .pager-text:has-text('1/2')", timeout=10_000)
    assert page.locator(".msg .msg-body").all_inner_texts() == texts
