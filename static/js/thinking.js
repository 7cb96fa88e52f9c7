// A reply's thinking (delta.reasoning_content): a collapsible block above the answer that streams live,
// folds when the answer starts and then says how long the thinking took. The text goes through
// MarkdownView, so it is DOMPurify.sanitize(marked.parse(...)) like the answer. No network, no chat state.
import { MarkdownView } from './render.js';

// Message key → the user's own open/closed choice, kept while the page lives (a re-render keeps it;
// a reload starts folded again).
const chosen = new Map();

function secondsText(s) {
  if (s == null) return '';
  return s < 10 ? `${Number(s).toFixed(1)} s` : `${Math.round(s)} s`;
}

// Seconds the reply spent thinking: measured here while it streams, the server's record after.
export function thinkingSeconds(m) {
  if (m.thinkStart != null) return ((m.thinkEnd ?? Date.now()) - m.thinkStart) / 1000;
  return m.usage && m.usage.reasoning_s != null ? m.usage.reasoning_s : null;
}

export class ThinkingView {
  constructor(host, copy) {
    this.box = document.createElement('details');
    this.box.className = 'thinking';
    this.summary = document.createElement('summary');
    this.summary.className = 'thinking-summary';
    this.body = document.createElement('div');
    this.body.className = 'thinking-body';
    this.box.append(this.summary, this.body);
    this.view = new MarkdownView(this.body, copy);
    this.key = null;
    this.programmatic = false;
    this.box.addEventListener('toggle', () => {
      if (!this.programmatic && this.key) chosen.set(this.key, this.box.open);
      this.programmatic = false;
    });
    host.before(this.box);
  }

  // m: the message ({reasoning_content, content, streaming, id}); `thinking`: reasoning is still streaming.
  update(m) {
    const text = m.reasoning_content || '';
    this.box.hidden = !text;
    if (!text) return;
    this.key = m.id || this.key || `live-${m.thinkStart}`;
    const thinking = !!m.streaming && !m.content && !m.finish_reason;
    this.box.classList.toggle('live', thinking);
    const secs = thinkingSeconds(m);
    this.summary.textContent = thinking ? 'Thinking…' : (secs != null ? `Thought for ${secondsText(secs)}` : 'Thoughts');
    const open = thinking ? true : (chosen.has(this.key) ? chosen.get(this.key) : false);
    if (this.box.open !== open) { this.programmatic = true; this.box.open = open; }
    this.view.update(text, thinking);
  }
}

// The model's thinking switch for one chat: on (the template's default) or off (reasoning_effort "none").
export function thinkingOn(params) { return !params || params.reasoning_effort !== 'none'; }

export function withThinking(params, on) {
  const out = { ...(params || {}) };
  if (on) delete out.reasoning_effort; else out.reasoning_effort = 'none';
  return out;
}
