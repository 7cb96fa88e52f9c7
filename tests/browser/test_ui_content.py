"""The UI's content in Chromium: markdown fidelity (line breaks, KaTeX math, task lists, quotes, code
labels without guessing), incremental rendering of long replies, settings checked against the server's
limits, the model name and picker, search over chats, new-chat defaults, the edit box's keys, and prompt
progress shown from server events."""
from __future__ import annotations

from typing import Any, AsyncIterator, Iterator

import pytest
from starlette.responses import JSONResponse

from browser_support import LiveServer
from session_fakes import ScriptedChat, make_app
from test_ui_chat import open_ui, send, visible_while_streaming, wait_js

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

MODELS = [{"id": "tiny-chat", "object": "model", "max_model_len": 4096},
          {"id": "tiny-code", "object": "model", "max_model_len": 4096}]


class ProgressChat(ScriptedChat):
    """Sends the contract's prompt-progress items (docs/sessions-api.md §5) before the reply."""

    progress: list[dict] = []
    pause_s = 0.0

    async def stream(self, state: Any, req: dict, **kw: Any) -> AsyncIterator[dict]:
        import asyncio
        for p in self.progress:
            yield p
            await asyncio.sleep(self.pause_s)
        async for c in super().stream(state, req, **kw):
            yield c


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[LiveServer, ProgressChat]]:
    chat = ProgressChat()
    app = make_app(chat, model_names=tuple(m["id"] for m in MODELS))     # a session may pick either
    models = {"data": MODELS[:1]}
    app.add_route("/v1/models", lambda r: JSONResponse({"object": "list", "data": models["data"]}))
    with LiveServer(app) as srv:
        srv.models = models
        yield srv, chat


@pytest.fixture
def chat(chat, live) -> ProgressChat:
    srv, _ = live
    chat.progress = []
    chat.pause_s = 0.0
    srv.models["data"] = MODELS[:1]
    return chat


RICH = """A haiku:
old pond
a frog jumps in
the sound of water

Euler: $e^{i\\pi} + 1 = 0$, and a price of $5 and $10 stays text.

$$\\int_0^1 x\\,dx = \\frac{1}{2}$$

- [x] write the parser
- [ ] ship it

> a quoted line

```
function plain() { return 1; }
```

```python
def f():
    return 1
```
"""


def test_markdown_fidelity(live, chat, page):
    srv, _ = live
    chat.reply = lambda m: RICH
    open_ui(page, srv)
    send(page, "show me markdown")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=15_000)
    body = page.locator(".msg.assistant .msg-body")
    assert "old pond\na frog jumps in\nthe sound of water" in body.inner_text()        # single newlines kept
    page.wait_for_selector(".msg.assistant .katex", timeout=10_000)                   # KaTeX loaded on demand
    tex = page.evaluate("[...document.querySelectorAll('.msg.assistant .katex-mathml annotation')]"
                        ".map((a) => a.textContent)")
    assert "e^{i\\pi} + 1 = 0" in tex and any("\\frac{1}{2}" in t for t in tex)
    assert body.locator(".katex-display").count() == 1
    assert "$5 and $10" in body.inner_text()                                          # prices are not math
    boxes = body.locator("li input[type=checkbox]")
    assert boxes.count() == 2 and boxes.nth(0).is_checked() and not boxes.nth(1).is_checked()
    assert all(boxes.nth(i).is_disabled() for i in range(2))
    assert page.evaluate("getComputedStyle(document.querySelector('.msg-body blockquote')).borderLeftWidth") == "3px"
    codes = body.locator("pre code")
    assert codes.nth(0).locator("span[class^=hljs-]").count() == 0                     # no guessing
    assert codes.nth(1).locator("span.hljs-keyword").count() >= 1                      # named: coloured
    assert body.locator(".code-lang").all_inner_texts() == ["text", "python"]
    assert page.evaluate("document.fonts.check('16px KaTeX_Main')")
    assert not page.errors                                                             # the CSP holds


GROW = """async (n) => {
  const { MarkdownView, renderStats } = await import('/static/js/render.js');
  const para = (i) => `Paragraph ${i} has **bold** words, \\`code\\`, and a [link](https://example.com/${i}).\\n\\n`;
  let text = '';
  for (let i = 0; text.length < n; i++) text += para(i) + (i % 10 === 5 ? '```js\\nlet x = ' + i + ';\\n```\\n\\n' : '');
  const el = document.createElement('div');
  const view = new MarkdownView(el, () => {});
  renderStats.parsedChars = 0;
  let steps = 0;
  for (let end = 40; end < text.length; end += 40) { view.update(text.slice(0, end), true); steps++; }
  const streamed = renderStats.parsedChars;
  view.update(text, false);
  return { n: text.length, steps, streamed, html: el.innerText.length, paragraphs: el.querySelectorAll('p').length };
}"""


def test_streaming_render_does_not_reparse_finished_blocks(live, page):
    srv, _ = live
    open_ui(page, srv)
    r = page.evaluate(GROW, 60_000)
    assert r["n"] >= 60_000 and r["steps"] > 1000 and r["paragraphs"] > 500
    # re-parsing everything each update would parse steps × n / 2 ≈ 45M characters; finished blocks are
    # parsed once, so the total stays a small multiple of the reply's length
    assert r["streamed"] < 4 * r["n"], r


def test_settings_are_checked_against_the_servers_limits(live, chat, page):
    srv, _ = live
    open_ui(page, srv)
    send(page, "hello")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
    sid = page.evaluate("location.hash.slice(1)")
    page.click("#toggle-settings")
    assert "4096" in page.get_attribute("#p-max_tokens", "placeholder")               # the server's default
    page.fill("#p-temperature", "5")
    page.fill("#p-max_tokens", "100000")
    page.click("#save-settings")
    page.wait_for_selector("#err-temperature:has-text('at most 2')")
    page.wait_for_selector("#err-max_tokens:has-text('at most 4096')")
    assert page.get_attribute("#p-temperature", "aria-invalid") == "true"
    page.wait_for_timeout(300)
    ui_defaults = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}       # a new chat's (issue 31)
    assert page.request.get(f"{srv.url}/v1/sessions/{sid}").json()["params"] == ui_defaults   # nothing saved
    page.fill("#p-temperature", "0.7")
    page.fill("#p-max_tokens", "")
    page.fill("#system-prompt", "You are a pirate.")
    page.click("#save-settings")
    page.wait_for_selector("#save-settings:has-text('Saved')")
    assert page.request.get(f"{srv.url}/v1/sessions/{sid}").json()["params"] == {**ui_defaults, "temperature": 0.7}
    # a new chat starts from the defaults, not from the previous chat's settings
    page.click("#new-chat")
    assert page.input_value("#system-prompt") == "" and page.input_value("#p-temperature") == "0.8"


def test_model_name_picker_search_and_new_chat_listed_at_once(live, chat, page):
    srv, _ = live
    open_ui(page, srv)
    page.wait_for_selector("#model-name:has-text('tiny-chat')")
    assert page.is_hidden("#model-picker")
    srv.models["data"] = MODELS
    page.reload()
    page.wait_for_selector("body[data-ready='1']")
    assert page.is_visible("#model-picker") and page.locator("#model-picker option").count() == 2
    page.select_option("#model-picker", "tiny-code")
    chat.reply = lambda m: "a slow reply about zebras " * 100
    chat.delay_s = 0.02
    send(page, "tell me about stripes")
    visible_while_streaming(page, min_chars=40)                                  # "zebras" is on screen
    sid = page.evaluate("location.hash.slice(1)")
    assert page.locator(f".session-item[data-id='{sid}']").count() == 1             # listed while it streams
    page.keyboard.press("Escape")
    page.wait_for_selector(".msg.assistant:not(.streaming)", timeout=15_000)
    assert page.request.get(f"{srv.url}/v1/sessions/{sid}").json()["model"] == "tiny-code"
    assert chat.requests[-1]["req"]["model"] == "tiny-code"
    chat.reply = lambda m: "nothing special"
    chat.delay_s = 0.0
    page.click("#new-chat")
    send(page, "weather today")
    wait_js(page, "document.querySelectorAll('.session-item').length >= 2")
    page.fill("#search", "zebras")                                                 # only in a reply's content
    wait_js(page, f"document.querySelectorAll('.session-item').length == 1 && "
                  f"document.querySelector('.session-item').dataset.id == '{sid}'")
    page.fill("#search", "weather")                                                # a title
    wait_js(page, "document.querySelectorAll('.session-item').length == 1")
    assert page.inner_text(".session-item .session-title").startswith("weather")
    page.fill("#search", "no such words anywhere")
    page.wait_for_selector("#search-empty", state="visible")


def test_edit_box_enter_sends_escape_cancels(live, chat, page):
    srv, _ = live
    open_ui(page, srv)
    send(page, "original")
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
    page.click(".msg.user .edit")
    page.fill(".edit-box", "changed my mind")
    page.keyboard.press("Escape")
    page.wait_for_selector(".edit-box", state="detached")
    assert page.inner_text(".msg.user .msg-body") == "original"
    assert page.is_visible("#send")                                                # Esc did not "stop" anything
    page.click(".msg.user .edit")
    page.fill(".edit-box", "edited question")
    page.keyboard.press("Enter")
    wait_js(page, "document.querySelector('.msg.assistant .msg-body').innerText == 'echo: edited question'")
    assert page.inner_text(".msg.user .msg-body") == "edited question"


def test_prompt_progress_from_server_events(live, chat, page):
    srv, _ = live
    chat.progress = [
        {"object": "chatserve.turn.progress", "turn_id": "t1", "phase": "queued", "queue_position": 2},
        {"object": "chatserve.turn.progress", "turn_id": "t1", "phase": "prefill", "prefill_done": 512,
         "prefill_total": 2048, "cached_tokens": 256},
    ]
    chat.pause_s = 1.0
    open_ui(page, srv)
    send(page, "a long prompt")
    page.wait_for_selector(".msg.assistant.streaming .progress:has-text('queued: position 2')", timeout=10_000)
    page.wait_for_selector(".msg.assistant.streaming .progress:has-text('512 / 2048')", timeout=10_000)
    assert page.get_attribute(".prefill-bar", "value") == "512"
    page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
    assert page.locator(".progress").count() == 0
    assert page.inner_text(".msg.assistant .msg-body") == "echo: a long prompt"
