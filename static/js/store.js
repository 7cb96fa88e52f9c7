// Chat data for the page: the session list, the open session and the reply being streamed.
// No DOM and no network here: app.js renders this state, api.js fills it.

export class ChatState extends EventTarget {
  constructor() {
    super();
    this.sessions = [];        // summaries, newest first
    this.current = null;       // the open session: {id, title, system_prompt, params, messages, ...}
    this.live = new Map();     // session id → {session, control}: turns this tab is following (any chat)
    this.storeStatus = null;   // {backend, persistent, degraded, pending_writes}
    this.maxContext = null;    // the model's context length when the server says it
  }

  emit(what, sid = null) { this.dispatchEvent(new CustomEvent('change', { detail: { what, sid } })); }

  setSessions(list) { this.sessions = list; this.emit('sessions'); }

  // A session whose turn this tab follows stays the same object, so its stream keeps filling it.
  setCurrent(session) {
    const live = session && this.live.get(session.id);
    this.current = live ? live.session : (session ? { ...session, messages: [...(session.messages || [])] } : null);
    this.emit('current');
  }

  setStoreStatus(status) { this.storeStatus = status; this.emit('status'); }

  busy(sid) { return !!sid && this.live.has(sid); }
  get replying() { return this.busy(this.current?.id); }

  // Mirror of the server's turn semantics, applied locally while the reply streams in.
  startReply(session, { content, replace_from, regenerate }, control) {
    const msgs = session.messages;
    if (replace_from !== undefined && replace_from !== null) msgs.splice(replace_from);
    else if (regenerate) while (msgs.length && msgs[msgs.length - 1].role === 'assistant') msgs.pop();
    if (content !== undefined && content !== null) msgs.push({ role: 'user', content, created: Date.now() / 1000, pending: true });
    return this.follow(session, control, { role: 'assistant', content: '', streaming: true, usage: null, finish_reason: null });
  }

  // Follow a turn that is already generating (re-attach): its last message is the partial reply.
  attachReply(session, control) {
    const msgs = session.messages;
    const last = msgs[msgs.length - 1];
    const reply = last && last.role === 'assistant' && (last.status === 'generating' || last.finish_reason == null)
      ? msgs.pop() : { role: 'assistant', content: '' };
    return this.follow(session, control, { ...reply, streaming: true, usage: null, finish_reason: null, replaceNext: true });
  }

  follow(session, control, reply) {
    session.messages.push(reply);
    this.live.set(session.id, { session, control });
    this.emit('reply-start', session.id);
    return reply;
  }

  replyOf(sid) {
    const l = this.live.get(sid);
    const m = l?.session.messages;
    return m && m.length && m[m.length - 1].streaming ? m[m.length - 1] : null;
  }

  // The server took the turn: the user's message is no longer only in the composer.
  accepted(sid) {
    const l = this.live.get(sid);
    for (const m of l?.session.messages || []) delete m.pending;
    this.emit('accepted', sid);
  }

  // One stream item: text chunks, or chatserve.turn / chatserve.turn.progress events.
  applyItem(sid, item) {
    const r = this.replyOf(sid);
    if (!r || !item) return;
    if (item.object === 'chatserve.turn') {
      r.id = item.message_id || r.id;
      r.turnId = item.id;
      if (item.replay) r.replaceNext = true;
      return;
    }
    if (item.object === 'chatserve.turn.progress') {
      r.progress = item;
      this.emit('reply-delta', sid);
      return;
    }
    if (item.object && item.object !== 'chat.completion.chunk') return;
    for (const ch of item.choices || []) {
      const text = ch.delta && typeof ch.delta.content === 'string' ? ch.delta.content : null;
      const thought = ch.delta && typeof ch.delta.reasoning_content === 'string' ? ch.delta.reasoning_content : null;
      if (text !== null && r.replaceNext) {          // a replay: the reply so far, thinking included
        r.content = text;
        r.reasoning_content = thought || '';
        r.replaceNext = false;
        if (r.reasoning_content && !r.thinkStart) r.thinkStart = Date.now();
        if (r.reasoning_content && r.content) r.thinkEnd = Date.now();
      } else {
        if (thought) {
          r.reasoning_content = (r.reasoning_content || '') + thought;
          if (!r.thinkStart) r.thinkStart = Date.now();
        }
        if (text) {
          r.content += text;
          if (r.thinkStart && !r.thinkEnd) r.thinkEnd = Date.now();   // the answer starts: thinking folds
        }
      }
      if (text || thought) r.progress = null;
      if (ch.finish_reason) r.finish_reason = ch.finish_reason;
    }
    if (item.usage) r.usage = usageFromChunk(item.usage);
    this.emit('reply-delta', sid);
  }

  // The stream ended (normally, stopped, failed or lost): the bubble is never left "streaming".
  endReply(sid, error = null) {
    const r = this.replyOf(sid);
    const l = this.live.get(sid);
    if (r) {
      r.streaming = false;
      r.progress = null;
      if (error) { r.error = error; if (!r.finish_reason) r.finish_reason = 'interrupted'; }
    }
    if (l) {
      const msgs = l.session.messages;
      if (error && r && !r.content && msgs.length >= 2 && msgs[msgs.length - 2].pending) msgs.splice(-2);
      else if (error && r && !r.content && !r.id) msgs.pop();
    }
    this.live.delete(sid);
    this.emit('reply-end', sid);
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
    reasoning_tokens: (u.completion_tokens_details || {}).reasoning_tokens,
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

// Sampling fields the settings panel edits; empty inputs mean "server default". The ranges are the
// server's own (chatserve/server/protocol.py); `lo_open` means the low end itself is refused.
export const SAMPLING_FIELDS = {
  temperature: { conv: Number, min: 0, max: 2 },
  top_p: { conv: Number, min: 0, max: 1, lo_open: true },
  top_k: { conv: Number, min: -1, int: true },
  min_p: { conv: Number, min: 0, max: 1 },
  max_tokens: { conv: Number, min: 1, int: true },
  repetition_penalty: { conv: Number, min: 0, max: 2, lo_open: true },
  seed: { conv: Number, min: -(2 ** 63), max: 2 ** 64 - 1, int: true },
};

// What a new chat starts from, shown and editable in Settings: llama.cpp's UI defaults, which keep a
// small model coherent (OpenAI's temperature 1 with no truncation samples from the whole tail). A
// model's own recommendation (/v1/models `sampling_defaults`: its generation_config.json or GGUF
// general.sampling.* keys) wins field by field.
export const UI_SAMPLING_DEFAULTS = { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05 };

export function newChatDefaults(model) {
  const out = { ...UI_SAMPLING_DEFAULTS };
  const rec = (model && model.sampling_defaults) || {};
  for (const k of Object.keys(UI_SAMPLING_DEFAULTS)) if (typeof rec[k] === 'number') out[k] = rec[k];
  return out;
}

// {params, errors}: errors maps a field to a sentence; `limits` may tighten max_tokens to the context.
export function paramsFromInputs(values, limits = {}) {
  const params = {};
  const errors = {};
  for (const [k, f] of Object.entries(SAMPLING_FIELDS)) {
    const raw = values[k];
    if (raw === undefined || raw === null || String(raw).trim() === '') continue;
    const v = f.conv(String(raw).trim());
    const max = k === 'max_tokens' && limits.maxContext ? limits.maxContext : f.max;
    if (!Number.isFinite(v)) errors[k] = 'must be a number';
    else if (f.int && !Number.isInteger(v)) errors[k] = 'must be a whole number';
    else if (f.lo_open ? v <= f.min : v < f.min) errors[k] = `must be ${f.lo_open ? 'above' : 'at least'} ${f.min}`;
    else if (max !== undefined && v > max) errors[k] = `must be at most ${max}`;
    else params[k] = v;
  }
  return { params, errors };
}
