"""Makes docs/ui-light.png, docs/ui-dark.png and docs/ui-mobile.png (not a test).

    .venv/bin/python tests/browser/screenshot.py [--out-dir docs]

Serves the session routes with a scripted backend (tests/sessions/session_fakes.py), so the pictures show
what the UI does with math, code, task lists and a reply mid-stream, whatever model is installed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from browser_support import CHROMIUM, CHROMIUM_ARGS, LiveServer  # noqa: E402
from session_fakes import ScriptedChat, make_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

ANSWER = """A palindrome reads the same both ways. Compare the string with its reverse:

```python
def is_palindrome(s: str) -> bool:
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]
```

It runs in $O(n)$ time. For a string of length $n$ there are $\\lfloor n/2 \\rfloor$ comparisons:

$$\\sum_{i=0}^{\\lfloor n/2 \\rfloor - 1} [\\,s_i = s_{n-1-i}\\,]$$

- [x] ignore case
- [x] ignore punctuation
- [ ] handle Unicode normalization

> "A man, a plan, a canal: Panama" → `True`"""


def reply(messages: list[dict]) -> str:
    q = messages[-1]["content"]
    if "haiku" in q:
        return "old pond\na frog jumps in\nthe sound of water"
    if "palindrome" in q:
        return ANSWER
    return "Sure. Here is a short example that uses it on a list of words, keeping only the palindromes " * 4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(ROOT / "docs"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    from starlette.responses import JSONResponse
    chat = ScriptedChat(reply=reply)
    app = make_app(chat)
    app.add_route("/v1/models", lambda r: JSONResponse({"object": "list", "data": [
        {"id": "SmolLM2-135M-Instruct", "object": "model", "max_model_len": 8192}]}))
    out = Path(args.out_dir)
    shots = [("ui-light.png", "light", {"width": 1280, "height": 860}, False),
             ("ui-dark.png", "dark", {"width": 1280, "height": 860}, False),
             ("ui-mobile.png", "light", {"width": 390, "height": 800}, True)]
    with LiveServer(app) as srv, sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        for name, scheme, viewport, mobile in shots:
            ctx = b.new_context(viewport=viewport, device_scale_factor=2 if mobile else 1, color_scheme=scheme,
                                is_mobile=mobile, has_touch=mobile)
            page = ctx.new_page()
            page.goto(srv.url + "/")
            page.wait_for_selector("body[data-ready='1']")
            chat.delay_s = 0.0
            for q in ("Write a haiku about a pond.",
                      "Write a Python function that checks whether a string is a palindrome."):
                n = page.locator(".msg.assistant:not(.streaming)").count()
                page.fill("#input", q)
                page.keyboard.press("Enter")
                page.wait_for_selector(f".msg.assistant:not(.streaming) >> nth={n}", timeout=30_000)
            page.wait_for_selector(".katex", timeout=10_000)
            if not mobile:
                chat.delay_s = 0.05
                page.fill("#input", "Thanks! Now show me a short example of using it.")
                page.keyboard.press("Enter")
                page.wait_for_selector(".msg.assistant.streaming", timeout=30_000)
                time.sleep(1.5)                              # mid-stream
            else:
                page.evaluate("document.getElementById('messages').scrollTop = 1e9")
            time.sleep(0.5)
            page.screenshot(path=str(out / name))
            if not mobile:
                page.keyboard.press("Escape")
                page.wait_for_selector(".msg.assistant:not(.streaming) >> nth=2", timeout=30_000)
            ctx.close()
            print(out / name)
        b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
