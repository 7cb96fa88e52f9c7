"""The UI's files: vendored libraries match their checksums, no inline or remote code, strict CSP."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from starlette.testclient import TestClient

from session_fakes import ScriptedChat, make_app

STATIC = Path(__file__).resolve().parents[2] / "static"


def test_vendored_files_match_checksums():
    for vendor, need in ((STATIC / "vendor", ("marked.esm.js", "purify.es.mjs", "highlight.min.js", "katex.mjs",
                                               "katex.min.css", "fonts/KaTeX_Main-Regular.woff2")),
                         (Path(__file__).parent / "vendor", ("axe.min.js",))):
        listed = {}
        for line in (vendor / "CHECKSUMS.sha256").read_text().splitlines():
            digest, name = line.split()
            listed[name] = digest
            assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
        present = {p.relative_to(vendor).as_posix() for p in vendor.rglob("*") if p.is_file()}
        present -= {"CHECKSUMS.sha256", "SOURCES.txt"}
        assert present == set(listed), "every vendored file is pinned, and nothing pinned is missing"
        for name in need:
            assert name in listed


def test_katex_fonts_referenced_by_its_css_are_vendored():
    css = (STATIC / "vendor" / "katex.min.css").read_text()
    woff2 = set(re.findall(r"url\((fonts/[^)]+\.woff2)\)", css))
    assert len(woff2) >= 15 and all((STATIC / "vendor" / f).is_file() for f in woff2)


def test_no_inline_scripts_styles_or_remote_resources():
    html = (STATIC / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>", html):
        assert "src=" in tag and 'type="module"' in tag
    assert re.search(r"<script\b[^>]*>\s*[^<\s]", html) is None           # no inline script bodies
    assert " style=" not in html and "<style" not in html
    assert re.search(r"\son[a-z]+=", html) is None                       # no inline handlers
    for path in [STATIC / "index.html", *(STATIC / "js").glob("*.js"), *(STATIC / "css").glob("*.css")]:
        text = path.read_text()
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), path
        assert not re.search(r"from\s+['\"]https?://", text), path
        assert "innerHTML" not in text or path.name == "render.js", f"{path.name}: only render.js sets HTML"


def test_ui_responses_carry_a_strict_csp():
    # sync on purpose: the browser tests' Playwright owns this thread's event loop
    with TestClient(make_app(ScriptedChat())) as c:
        for url in ("/", "/static/js/app.js", "/static/vendor/purify.es.mjs"):
            r = c.get(url)
            assert r.status_code == 200, url
            csp = r.headers["content-security-policy"]
            assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
            assert "frame-ancestors 'none'" in csp and r.headers["x-content-type-options"] == "nosniff"
        assert c.get("/static/js/app.js").headers["content-type"].startswith(("text/javascript",
                                                                                     "application/javascript"))
        assert c.get("/static/../chatserve/config.py").status_code == 404
        assert "content-security-policy" not in c.get("/v1/sessions").headers
