"""The model picker against a real `chatserve serve` with two models (issue 32), in real Chromium: it
lists both with the unloaded one marked, and a chat on the unloaded one shows "loading model…" until its
first token, then the model is listed as loaded."""
from __future__ import annotations

import pytest

from browser_support import ServeProcess
from test_ui_chat import open_ui, send, wait_js

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

# every text the reply's progress line and body had, in order (CSP forbids eval: installed by evaluate)
WATCH = """(() => {
  window.__seen = [];
  const note = () => {
    const m = [...document.querySelectorAll('.msg.assistant')].pop();
    if (!m) return;
    const p = m.querySelector('.stat.progress');
    const entry = (p ? 'progress:' + p.textContent : '') + '|body:' + m.querySelector('.msg-body').innerText;
    if (window.__seen[window.__seen.length - 1] !== entry) window.__seen.push(entry);
  };
  new MutationObserver(note).observe(document.body, { subtree: true, childList: true, characterData: true });
})()"""


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> str:
    from chatserve.runtime.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("second") / "m2", seed=1)


def test_picker_lists_the_models_and_a_cold_one_shows_loading_until_its_first_token(
        browser, tiny_model, second_model, tmp_path):
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    page = ctx.new_page()
    try:
        with ServeProcess(tiny_model, tmp_path / "serve.log", "--model", f"second={second_model}",
                          "--kv-blocks", "64") as srv:
            open_ui(page, srv)
            options = page.locator("#model-picker option")
            assert page.is_visible("#model-picker")
            assert options.all_inner_texts() == ["m", "second (not loaded)"]
            page.select_option("#model-picker", "second")
            page.evaluate(WATCH)
            send(page, "Hello there")
            wait_js(page, "document.querySelectorAll('.msg.assistant:not(.streaming) .stat-ttft').length == 1",
                    timeout=120_000)
            seen = page.evaluate("window.__seen")
            loading = [i for i, s in enumerate(seen) if s.startswith("progress:loading model…")]
            texted = [i for i, s in enumerate(seen) if not s.endswith("|body:")]
            assert loading and texted and loading[0] < texted[0], seen   # shown first, gone with the text
            assert not any("loading model" in s for s in seen[texted[0]:]), seen
            models = page.request.get(f"{srv.url}/v1/models").json()["data"]
            assert {m["id"]: m["status"] for m in models} == {"m": "loaded", "second": "loaded"}
            wait_js(page, "[...document.querySelectorAll('#model-picker option')].every("
                          "(o) => !o.textContent.includes('not loaded'))")
            assert page.input_value("#model-picker") == "second"
    finally:
        ctx.close()
