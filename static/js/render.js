// Model output to safe HTML: DOMPurify.sanitize(marked.parse(text)), then highlighting once a reply ends.
// Nothing from the model is ever inserted without passing through DOMPurify.
import { marked } from '../vendor/marked.esm.js';
import DOMPurify from '../vendor/purify.es.mjs';
import hljs from '../vendor/highlight.min.js';

marked.setOptions({ gfm: true, breaks: false });
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
});

const PURIFY = {
  FORBID_TAGS: ['style', 'form', 'input', 'button', 'textarea', 'select', 'iframe', 'object', 'embed'],
  FORBID_ATTR: ['style'],
};

export function toSafeHtml(markdown) {
  return DOMPurify.sanitize(marked.parse(markdown || ''), PURIFY);
}

export function renderMarkdown(el, markdown) {
  el.innerHTML = toSafeHtml(markdown);
}

// Highlight code blocks and give each a copy button (called when a reply is complete).
export function finishCode(el, copy) {
  for (const code of el.querySelectorAll('pre > code')) {
    if (code.dataset.done) continue;
    code.dataset.done = '1';
    try { hljs.highlightElement(code); } catch (e) { /* unknown language: leave it plain */ }
    const btn = document.createElement('button');
    btn.type = 'button';
    btn.className = 'code-copy';
    btn.textContent = 'Copy';
    btn.addEventListener('click', () => copy(code.textContent, btn));
    code.parentElement.classList.add('has-copy');
    code.parentElement.appendChild(btn);
  }
}
