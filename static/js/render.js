// Model output to safe DOM: DOMPurify.sanitize(marked.parse(text)), math typeset by KaTeX into the
// sanitized tree, code labelled and highlighted only when its language is named. While a reply
// streams, finished blocks are parsed once and kept; only the unfinished tail is parsed again each frame.
import { marked } from '../vendor/marked.esm.js';
import DOMPurify from '../vendor/purify.es.mjs';
import hljs from '../vendor/highlight.min.js';

// ── math: $…$, \(…\), $$…$$ and \[…\] become placeholders that KaTeX fills after sanitizing ─────
const escapeAttr = (s) => s.replace(/&/g, '&amp;').replace(/"/g, '&quot;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
const mathHtml = (tex, display) => {
  const t = escapeAttr(tex.trim());
  return display ? `<div class="math display" data-tex="${t}">${t}</div>\n` : `<span class="math" data-tex="${t}">${t}</span>`;
};
const BLOCK_MATH = /^ {0,3}(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\])[ \t]*(?:\n|$)/;
const INLINE_MATH = /^(?:\$(?!\s)((?:\\.|[^\\$\n])+?)(?<!\s)\$(?![0-9])|\\\(([\s\S]+?)\\\))/;
marked.use({
  gfm: true,
  breaks: true,                                   // a single newline is a line break (poems, addresses)
  extensions: [
    { name: 'blockMath', level: 'block',
      start: (src) => { const m = src.match(/(?:^|\n) {0,3}(?:\$\$|\\\[)/); return m ? m.index + (m[0][0] === '\n' ? 1 : 0) : undefined; },
      tokenizer(src) { const m = BLOCK_MATH.exec(src); return m ? { type: 'blockMath', raw: m[0], tex: m[1] ?? m[2] } : undefined; },
      renderer: (t) => mathHtml(t.tex, true) },
    { name: 'inlineMath', level: 'inline',
      start: (src) => { const i = src.search(/\$|\\\(/); return i < 0 ? undefined : i; },
      tokenizer(src) { const m = INLINE_MATH.exec(src); return m ? { type: 'inlineMath', raw: m[0], tex: m[1] ?? m[2] } : undefined; },
      renderer: (t) => mathHtml(t.tex, false) },
  ],
  renderer: {
    checkbox({ checked }) {
      return `<input type="checkbox" disabled${checked ? ' checked' : ''} aria-label="${checked ? 'done' : 'not done'}"> `;
    },
  },
});
hljs.configure({ ignoreUnescapedHTML: true });

// Links open in a new tab without an opener; remote images are not fetched at all (a model could be
// led to leak the conversation through an image URL). The CSP (img-src 'self' data:) backs this up.
DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
  if (node.tagName === 'IMG') {
    const src = node.getAttribute('src') || '';
    if (!/^data:image\//i.test(src)) {
      node.removeAttribute('src');
      node.removeAttribute('srcset');
      node.setAttribute('title', `image not loaded: ${src}`.slice(0, 300));
      node.classList.add('blocked-img');
    }
  }
  if (node.tagName === 'INPUT') {              // only the task-list box survives, and it cannot be ticked
    if (node.getAttribute('type') !== 'checkbox') node.remove();
    else { node.setAttribute('disabled', ''); node.removeAttribute('name'); node.removeAttribute('form'); }
  }
});

const PURIFY = {
  FORBID_TAGS: ['style', 'form', 'button', 'textarea', 'select', 'iframe', 'object', 'embed'],
  FORBID_ATTR: ['style'],
};

export const renderStats = { parsedChars: 0, updates: 0, ms: [] };   // read by tests and benchmarks

function safeFragment(markdown) {
  renderStats.parsedChars += markdown.length;
  return DOMPurify.sanitize(marked.parse(markdown || ''), { ...PURIFY, RETURN_DOM_FRAGMENT: true });
}

export function toSafeHtml(markdown) {
  return DOMPurify.sanitize(marked.parse(markdown || ''), PURIFY);
}

export function renderMarkdown(el, markdown) {
  el.replaceChildren(safeFragment(markdown));
  typesetMath(el);
}

// ── KaTeX, loaded on first use ───────────────────────────────────────────────────────────────
let katex = null;
let katexLoading = null;
function typesetMath(root) {
  const nodes = [...root.querySelectorAll('.math[data-tex]:not([data-done])')];
  if (!nodes.length) return;
  if (katex) { typeset(nodes); return; }
  katexLoading = katexLoading || import('../vendor/katex.mjs').then((m) => { katex = m.default; });
  katexLoading.then(() => typeset(nodes));
}

function typeset(nodes) {
  for (const n of nodes) {
    if (n.dataset.done) continue;
    n.dataset.done = '1';
    try {
      katex.render(n.dataset.tex, n, { displayMode: n.classList.contains('display'), throwOnError: false,
        trust: false, strict: 'ignore', maxSize: 50, maxExpand: 500, output: 'htmlAndMathml' });
    } catch (e) { n.textContent = n.dataset.tex; }
  }
}

// ── code blocks: a language label, a Copy button, keyboard scrolling; colours only when named ────
export function finishCode(el, copy) {
  for (const code of el.querySelectorAll('pre > code')) {
    if (code.dataset.done) continue;
    code.dataset.done = '1';
    const pre = code.parentElement;
    const lang = (/\blanguage-([\w+#.-]+)/.exec(code.className) || [])[1] || '';
    if (lang && hljs.getLanguage(lang)) {
      try { hljs.highlightElement(code); } catch (e) { /* leave it plain */ }
    } else code.classList.add('plain');        // no guessing: unlabelled code is shown as typed
    pre.tabIndex = 0;                             // a wide block scrolls with the keyboard
    pre.setAttribute('aria-label', lang ? `${lang} code` : 'code');
    const head = document.createElement('div');
    head.className = 'code-head';
    const label = document.createElement('span');
    label.className = 'code-lang';
    label.textContent = lang || 'text';
    const btn = document.createElement('button');
    btn.type = 'button';
    btn.className = 'code-copy';
    btn.textContent = 'Copy';
    btn.setAttribute('aria-label', `Copy ${lang || 'code'}`);
    btn.addEventListener('click', () => copy(code.textContent, btn));
    head.append(label, btn);
    pre.classList.add('has-copy');
    pre.prepend(head);
  }
}

// ── incremental rendering of a streaming reply ───────────────────────────────────────────────
// Where the finished part of `text` ends: after the last blank line that lies outside code fences and
// display math and is followed by a block that starts at the margin. Scanning starts at `from`
// (a previous cut, so outside any fence).
export function stableCut(text, from) {
  let cut = from;
  let fence = null;          // the open fence's marker, e.g. "```" or "~~~~"
  let math = false;
  let blank = false;
  let i = from;
  while (i < text.length) {
    const nl = text.indexOf('\n', i);
    if (nl < 0) break;                            // the last line is still being written
    const line = text.slice(i, nl);
    const next = nl + 1;
    if (fence) {
      const c = /^\s{0,3}(`{3,}|~{3,})\s*$/.exec(line);
      if (c && c[1][0] === fence[0] && c[1].length >= fence.length) fence = null;
    } else if (math) {
      if (/\$\$\s*$|\\\]\s*$/.test(line)) math = false;
    } else if (line.trim() === '') {
      blank = true;
    } else {
      if (blank && !/^[ \t]/.test(line)) cut = i;
      blank = false;
      const f = /^\s{0,3}(`{3,}|~{3,})/.exec(line);
      if (f) fence = f[1];
      else if (/^\s{0,3}(\$\$|\\\[)/.test(line) && !/^\s{0,3}(\$\$[\s\S]+\$\$|\\\[[\s\S]*\\\])\s*$/.test(line)) math = true;
    }
    i = next;
  }
  return cut;
}

const GROUP = 24;

// Renders one message body; while streaming, blocks before stableCut() are parsed once and appended.
export class MarkdownView {
  constructor(el, copy) {
    this.el = el;
    this.copy = copy;
    this.text = null;
    this.frozen = 0;        // characters parsed for good (finished blocks)
    this.chunks = [];       // finished blocks not yet grouped, as .md-chunk elements
    this.tail = [];         // the nodes of the unfinished tail, replaced every update
  }

  update(text, streaming) {
    if (text === this.text && streaming === this.streaming) return;
    const t0 = performance.now();
    if (!streaming) {
      renderMarkdown(this.el, text);
      finishCode(this.el, this.copy);
      this.reset(text, false);
      return;
    }
    if (this.text === null || !this.streaming || !text.startsWith(this.text)) {   // not an append: start over
      this.el.replaceChildren();
      this.frozen = 0;
      this.chunks = [];
      this.tail = [];
    }
    const cut = stableCut(text, this.frozen);
    for (const n of this.tail) n.remove();
    if (cut > this.frozen) {
      const chunk = document.createElement('div');
      chunk.className = 'md-chunk';
      chunk.append(safeFragment(text.slice(this.frozen, cut)));
      typesetMath(chunk);
      finishCode(chunk, this.copy);
      this.el.append(chunk);
      this.chunks.push(chunk);
      this.frozen = cut;
      if (this.chunks.length >= GROUP) {           // few top-level children keep each frame's layout small
        const group = document.createElement('div');
        group.className = 'md-chunk';
        this.el.insertBefore(group, this.chunks[0]);
        group.append(...this.chunks);
        this.chunks = [];
      }
    }
    const box = document.createElement('div');
    box.append(safeFragment(text.slice(this.frozen)));
    typesetMath(box);
    this.tail = [...box.childNodes];
    this.el.append(...this.tail);
    this.text = text;
    this.streaming = true;
    renderStats.updates += 1;
    renderStats.ms.push(performance.now() - t0);
    if (renderStats.ms.length > 5000) renderStats.ms.shift();
  }

  reset(text, streaming) { this.text = text; this.streaming = streaming; this.frozen = 0; this.chunks = []; this.tail = []; }
}
