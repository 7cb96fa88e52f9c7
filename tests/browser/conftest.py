"""Browser fixtures: Debian's Chromium driven by Playwright (see browser_support.py for the server).

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

from browser_support import CHROMIUM, CHROMIUM_ARGS  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    exe = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if exe is None:
        pytest.skip("Chromium not found: apt-get install -y chromium (tests never run `playwright install`)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright (the Python package) is not installed: pip install playwright")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()
