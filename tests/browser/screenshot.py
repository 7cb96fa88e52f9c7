"""Makes docs/ui-screenshot.png: the UI mid-conversation with the default model (not a test).

    .venv/bin/python tests/browser/screenshot.py [--model PATH] [--out docs/ui-screenshot.png]

Starts `chatserve serve` (with a throwaway redis-server when one is installed) and drives Chromium.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from browser_support import CHROMIUM, CHROMIUM_ARGS, ServeProcess  # noqa: E402
from session_fakes import RedisServer, redis_binary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "ui-screenshot.png"))
    ap.add_argument("--dark", action="store_true")
    args = ap.parse_args()
    from chatserve.config import default_model_path
    from playwright.sync_api import sync_playwright
    model = args.model or default_model_path()
    redis = RedisServer(redis_binary()) if redis_binary() else None
    extra = ["--kv-blocks", "512"]
    if redis:
        redis.start()
        extra += ["--redis-url", redis.url]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    try:
        with ServeProcess(model, log, *extra) as srv, sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            ctx = b.new_context(viewport={"width": 1280, "height": 820}, device_scale_factor=1,
                                color_scheme="dark" if args.dark else "light")
            page = ctx.new_page()
            page.goto(srv.url + "/")
            page.wait_for_selector("body[data-ready='1']")
            page.click("#toggle-settings")
            page.fill("#system-prompt", "You are a concise, friendly assistant.")
            page.fill("#p-temperature", "0.2")
            page.fill("#p-max_tokens", "160")
            page.fill("#p-seed", "7")
            page.click("#save-settings")
            time.sleep(0.5)
            page.click("#toggle-settings")
            for q in ("Write a Python function that checks whether a string is a palindrome.",
                      "What is the capital of France?"):
                page.fill("#input", q)
                page.keyboard.press("Enter")
                page.wait_for_selector(".msg.assistant:not(.streaming) .stat-ttft >> nth=-1", timeout=120_000)
                n = page.locator(".msg.assistant:not(.streaming) .stat-ttft").count()
                while page.locator(".msg.user").count() > n:
                    time.sleep(0.1)
                    n = page.locator(".msg.assistant:not(.streaming) .stat-ttft").count()
            page.fill("#input", "Thanks! Now show me a short example of using it.")
            page.keyboard.press("Enter")
            page.wait_for_selector(".msg.assistant.streaming", timeout=60_000)
            time.sleep(2.5)                              # mid-stream
            page.screenshot(path=args.out)
            page.click("#stop")
            b.close()
    finally:
        if redis:
            redis.stop()
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
