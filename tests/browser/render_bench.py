"""Frame cost of rendering a streaming reply in Chromium: incremental (MarkdownView) against a full
re-parse of the whole reply each frame (what the UI did before). Not a test; the figures go in
docs/benchmarks.md.

    .venv/bin/python tests/browser/render_bench.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from browser_support import CHROMIUM, CHROMIUM_ARGS, LiveServer  # noqa: E402
from session_fakes import ScriptedChat, make_app  # noqa: E402

BENCH = r"""async (sizes) => {
  const { MarkdownView, renderMarkdown } = await import('/static/js/render.js');
  const block = (i) => [
    `Paragraph ${i}: the **scheduler** admits requests while \`free blocks\` remain, and a [link](https://example.com/${i}).\n\n`,
    `- item one of ${i}\n- item two with *emphasis*\n- item three\n\n`,
    '```python\ndef f(x):\n    return x * ' + i + '\n```\n\n',
    `Inline math $a_${i % 10} = b^2$ and a table:\n\n| k | v |\n|---|---|\n| ${i} | ${i * 2} |\n\n`,
  ][i % 4];
  let text = '';
  for (let i = 0; text.length < Math.max(...sizes) + 2000; i++) text += block(i);
  const out = [];
  for (const n of sizes) {
    const host = document.createElement('div');
    host.className = 'msg-body';
    document.getElementById('messages').appendChild(host);
    const view = new MarkdownView(host, () => {});
    for (let end = 2000; end < n; end += 2000) { view.update(text.slice(0, end), true); void host.offsetHeight; }
    const inc = [];
    for (let k = 0; k < 30; k++) {
      const t0 = performance.now();
      view.update(text.slice(0, n + 16 * k), true);          // ~4 tokens per frame
      void host.offsetHeight;                                // include style and layout
      inc.push(performance.now() - t0);
    }
    const full = [];
    for (let k = 0; k < 8; k++) {
      const t0 = performance.now();
      renderMarkdown(host, text.slice(0, n + 16 * k));
      void host.offsetHeight;
      full.push(performance.now() - t0);
    }
    host.remove();
    const med = (a) => a.sort((x, y) => x - y)[a.length >> 1];
    out.push({ chars: n, incremental_ms: +med(inc).toFixed(2), full_ms: +med(full).toFixed(2),
               incremental_max_ms: +Math.max(...inc).toFixed(2) });
  }
  return out;
}"""


def main() -> int:
    from playwright.sync_api import sync_playwright
    with LiveServer(make_app(ScriptedChat())) as srv, sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = b.new_page(viewport={"width": 1200, "height": 800})
        page.goto(srv.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        rows = page.evaluate(BENCH, [10_000, 30_000, 60_000])
        b.close()
    print("chars   incremental median (max)   full re-parse median")
    for r in rows:
        print(f"{r['chars']:>6}   {r['incremental_ms']:>7.2f} ms ({r['incremental_max_ms']:.2f})   "
              f"{r['full_ms']:>8.2f} ms")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
