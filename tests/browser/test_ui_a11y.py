"""Accessibility in Chromium: axe-core (vendored in tests/browser/vendor, a test asset the app never
serves) finds nothing in light and dark, empty and with a chat and the settings open; keyboard reach;
screen-reader labels; the live region speaks once per reply, not once per frame."""
from __future__ import annotations

from pathlib import Path

import pytest

from test_ui_chat import open_ui, send, visible_while_streaming, wait_js

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

AXE = Path(__file__).parent / "vendor" / "axe.min.js"
RICH = ("Here is **code**:\n\n```python\n" + "x = 1  # a very long line " * 12 + "\n```\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |\n\n- [x] done\n- [ ] not yet\n\n> quoted\n\nand $x^2$ math.")


def axe_violations(page) -> list[str]:
    page.add_script_tag(path=str(AXE))          # the context bypasses the CSP for this test asset only
    res = page.evaluate("axe.run(document, {resultTypes: ['violations']})")
    return [f"{v['id']}: {v['help']} → {[n['target'] for n in v['nodes']][:4]}" for v in res["violations"]]


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_nothing_empty_and_with_a_chat_and_settings(live, chat, browser, scheme):
    srv, _ = live
    chat.reply = lambda m: RICH
    ctx = browser.new_context(viewport={"width": 1200, "height": 800}, color_scheme=scheme, bypass_csp=True)
    page = ctx.new_page()
    try:
        open_ui(page, srv)
        assert page.evaluate("document.documentElement.dataset.theme") == scheme
        assert axe_violations(page) == []
        send(page, "show me everything")
        page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=15_000)
        page.wait_for_selector(".msg.assistant .katex", timeout=10_000)
        page.click("#toggle-settings")
        page.fill("#p-temperature", "5")
        page.click("#save-settings")                    # a field error on screen too
        page.wait_for_selector("#err-temperature:not([hidden])")
        assert axe_violations(page) == []
    finally:
        ctx.close()


def test_keyboard_reach_labels_and_live_region(live, chat, browser):
    srv, _ = live
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    page = ctx.new_page()
    try:
        open_ui(page, srv)
        chat.reply = lambda m: "first reply"
        send(page, "one")
        page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
        page.click("#new-chat")
        send(page, "two")
        page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft", timeout=10_000)
        # icons shown only on hover are out of the tab order; the open chat's are visible and reachable
        tab = page.evaluate("""[...document.querySelectorAll('.session-item')].map((li) => [
            li.classList.contains('active'), [...li.querySelectorAll('.icon')].map((b) => b.tabIndex),
            [...li.querySelectorAll('.icon')].map((b) => getComputedStyle(b).opacity)])""")
        for active, idx, opacity in tab:
            assert idx == ([0, 0] if active else [-1, -1])
            if active:
                assert opacity == ["1", "1"]
        # Import is a real button: reachable with Tab, and Enter opens the file chooser
        page.focus("#new-chat")
        seen = []
        for _ in range(12):
            page.keyboard.press("Tab")
            seen.append(page.evaluate("document.activeElement.id || document.activeElement.className"))
            if seen[-1] == "import-chat":
                break
        assert "import-chat" in seen, seen
        page.evaluate("document.getElementById('import-file').addEventListener('click', (e) => {"
                      " window.__chooser = true; e.preventDefault(); })")
        page.keyboard.press("Enter")
        wait_js(page, "window.__chooser === true")
        labels = page.evaluate("[...document.querySelectorAll('.msg')].map((m) => m.getAttribute('aria-label'))")
        assert labels == ["You, message 1", "Assistant, message 2"]
        # the live region: the message list is not live; one announcement per finished reply
        assert page.get_attribute("#messages", "aria-live") == "off"
        page.evaluate("""window.__said = []; new MutationObserver(() => window.__said.push(
            document.getElementById('announcer').textContent)).observe(document.getElementById('announcer'),
            {childList: true, characterData: true, subtree: true})""")
        chat.reply = lambda m: "word " * 200
        chat.delay_s = 0.01
        send(page, "three")
        visible_while_streaming(page, min_chars=20)
        page.wait_for_selector(".msg.assistant >> nth=1 >> .stat-ttft", timeout=20_000)
        page.wait_for_timeout(300)
        said = page.evaluate("window.__said")
        assert len(said) == 1 and said[0].startswith("Reply finished: word word"), said
    finally:
        ctx.close()
