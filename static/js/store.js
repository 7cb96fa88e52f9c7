// Chat data for the page: the session list, the open session and the reply being streamed.
// No DOM and no network here: app.js renders this state, api.js fills it.

export class ChatState extends EventTarget {
  constructor() {
    super();
    this.sessions = [];        // summaries, newest first
    this.current = null;       // the open session: {id, title, system_prompt, params, messages, ...}
    this.replying = false;     // a reply is streaming into the last message
    this.storeStatus = null;   // {backend, persistent, degraded, pending_writes}
    this.maxContext = null;    // the model's context length when the server says it
  }

  emit(what) { this.dispatchEvent(new CustomEvent('change', { detail: what })); }

  setSessions(list) { this.sessions = list; this.emit('sessions'); }

  setCurrent(session) {
    this.current = session ? { ...session, messages: [...(session.messages || [])] } : null;
    this.emit('current');
  }

  setStoreStatus(status) { this.storeStatus = status; this.emit('status'); }

  // Mirror of the server's turn semantics, applied locally while the reply streams in.
  startReply({ content, replace_from, regenerate }) {
    const msgs = this.current.messages;
    if (replace_from !== undefined && replace_from !== null) msgs.splice(replace_from);
    else if (regenerate) while (msgs.length && msgs[msgs.length - 1].role === 'assistant') msgs.pop();
    if (content !== undefined && content !== null) msgs.push({ role: 'user', content, created: Date.now() / 1000 });
    msgs.push({ role: 'assistant', content: '', streaming: true, usage: null, finish_reason: null });
    this.replying = true;
    this.emit('reply-start');
  }

  get reply() {
    const m = this.current?.messages;
    return m && m.length && m[m.length - 1].streaming ? m[m.length - 1] : null;
  }

  applyChunk(chunk) {
    const r = this.reply;
    if (!r) return;
    if (chunk.error) { r.error = chunk.error.message || String(chunk.error); }
    for (const ch of chunk.choices || []) {
      if (ch.delta && ch.delta.content) r.content += ch.delta.content;
      if (ch.finish_reason) r.finish_reason = ch.finish_reason;
    }
    if (chunk.usage) r.usage = usageFromChunk(chunk.usage);
    this.emit('reply-delta');
  }

  endReply() {
    const r = this.reply;
    if (r) r.streaming = false;
    this.replying = false;
    this.emit('reply-end');
  }
}

// The per-turn record the server stores, from an OpenAI usage object with chatserve's extras.
export function usageFromChunk(u) {
  const x = u.chatserve || {};
  return {
    prompt_tokens: u.prompt_tokens,
    completion_tokens: u.completion_tokens,
    cached_tokens: (u.prompt_tokens_details || {}).cached_tokens || 0,
    ttft_s: x.ttft_s, tokens_per_s: x.tokens_per_s, queue_s: x.queue_s,
  };
}

export function formatStats(u) {
  if (!u) return [];
  const out = [];
  if (u.ttft_s != null) out.push(['ttft', `TTFT ${fmtSeconds(u.ttft_s)}`]);
  if (u.tokens_per_s != null) out.push(['tps', `${Number(u.tokens_per_s).toFixed(1)} tok/s`]);
  if (u.prompt_tokens != null) out.push(['prompt', `prompt ${u.prompt_tokens} (cached ${u.cached_tokens || 0})`]);
  if (u.completion_tokens != null) out.push(['completion', `${u.completion_tokens} tokens`]);
  return out;
}

function fmtSeconds(s) { return s < 1 ? `${Math.round(s * 1000)} ms` : `${Number(s).toFixed(2)} s`; }

// Tokens the conversation holds now: the last turn's prompt plus its reply.
export function contextUsage(session, maxContext) {
  const msgs = session?.messages || [];
  for (let i = msgs.length - 1; i >= 0; i--) {
    const u = msgs[i].usage;
    if (u && u.prompt_tokens != null) {
      const used = u.prompt_tokens + (u.completion_tokens || 0);
      return { used, max: maxContext, frac: maxContext ? Math.min(1, used / maxContext) : null };
    }
  }
  return { used: 0, max: maxContext, frac: maxContext ? 0 : null };
}

export function compactNumber(n) {
  if (n == null) return '?';
  return n >= 10000 ? `${Math.round(n / 1000)}k` : n >= 1000 ? `${(n / 1000).toFixed(1)}k` : String(n);
}

// Sampling fields the settings panel edits; empty inputs mean "server default".
export const SAMPLING_FIELDS = {
  temperature: Number, top_p: Number, top_k: v => parseInt(v, 10), min_p: Number,
  max_tokens: v => parseInt(v, 10), repetition_penalty: Number, seed: v => parseInt(v, 10),
};

export function paramsFromInputs(values) {
  const out = {};
  for (const [k, conv] of Object.entries(SAMPLING_FIELDS)) {
    const raw = values[k];
    if (raw === undefined || raw === null || String(raw).trim() === '') continue;
    const v = conv(raw);
    if (!Number.isNaN(v)) out[k] = v;
  }
  return out;
}
