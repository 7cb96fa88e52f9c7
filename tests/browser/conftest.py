"""Browser fixtures: Debian's Chromium driven by Playwright, a live app with a scripted model per test
module (`live`, `chat`), and a fresh page that records page errors and CSP violations (`page.errors`).

Never runs `playwright install`: it launches /usr/bin/chromium (apt-get install -y chromium) and skips
with that hint when it is missing.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browser_support import CHROMIUM, CHROMIUM_ARGS, LiveServer  # noqa: E402
from session_fakes import ScriptedChat, make_app  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    exe = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if exe is None:
        pytest.skip("Chromium not found: apt-get install -y chromium (tests never run `playwright install`)")
    from playwright.sync_api import sync_playwright      # a test dependency (pyproject [test])
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[LiveServer, ScriptedChat]]:
    chat = ScriptedChat()
    with LiveServer(make_app(chat)) as srv:
        yield srv, chat


@pytest.fixture
def chat(live) -> ScriptedChat:
    srv, chat = live
    chat.reply = lambda m: f"echo: {m[-1]['content']}"
    chat.delay_s = 0.0
    return chat


@pytest.fixture
def page(browser) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    pg.errors = errors
    yield pg
    ctx.close()
