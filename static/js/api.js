// Talking to the server: the session REST API and reply streaming (WebSocket first, SSE fallback).
// Streams are async generators of chat.completion.chunk objects. No DOM here.

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

const storeListeners = new Set();
export function onStoreHeader(fn) { storeListeners.add(fn); }
function noteStoreHeader(r) {
  const v = r.headers.get('x-chatserve-session-store');
  if (v) for (const fn of storeListeners) fn(v);
}

async function errorOf(r) {
  let msg = `${r.status} ${r.statusText}`;
  try { const j = await r.json(); if (j.error?.message) msg = j.error.message; } catch (e) { /* not JSON */ }
  return new ApiError(r.status, msg);
}

// With `chatserve serve --api-key`, the page asks for a key once per tab (sessionStorage) and sends it
// as a Bearer token, and as a WebSocket subprotocol (browsers cannot set headers there).
let apiKey = sessionStorage.getItem('chatserve-api-key') || '';
export function setApiKey(key) {
  apiKey = key || '';
  if (apiKey) sessionStorage.setItem('chatserve-api-key', apiKey);
  else sessionStorage.removeItem('chatserve-api-key');
  socket.reset();
}
function authHeaders(h = {}) { if (apiKey) h.authorization = `Bearer ${apiKey}`; return h; }

async function call(method, url, body) {
  const init = { method, credentials: 'same-origin', headers: authHeaders() };
  if (body !== undefined) {
    init.headers['content-type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(url, init);
  noteStoreHeader(r);
  if (!r.ok) throw await errorOf(r);
  return r.json();
}

const S = '/v1/sessions';
export const api = {
  list: () => call('GET', S).then((j) => j.data),
  create: (body = {}) => call('POST', S, body),
  get: (id) => call('GET', `${S}/${encodeURIComponent(id)}`),
  patch: (id, body) => call('PATCH', `${S}/${encodeURIComponent(id)}`, body),
  remove: (id) => call('DELETE', `${S}/${encodeURIComponent(id)}`),
  importDoc: (doc) => call('POST', `${S}/import`, doc),
  status: () => call('GET', `${S}/status`),
  cancel: (id) => call('POST', `${S}/${encodeURIComponent(id)}/cancel`, {}),
  exportUrl: (id) => `${S}/${encodeURIComponent(id)}/export`,
  models: () => call('GET', '/v1/models').then((j) => j.data || []).catch(() => []),
};

// A queue read by an async generator: push() from callbacks, iterate with for await.
function channel() {
  const items = [];
  let wake = null, done = false, error = null;
  const poke = () => { if (wake) { wake(); wake = null; } };
  return {
    push(x) { items.push(x); poke(); },
    close(err) { done = true; error = err || null; poke(); },
    async *[Symbol.asyncIterator]() {
      for (;;) {
        if (items.length) { yield items.shift(); continue; }
        if (done) { if (error) throw error; return; }
        await new Promise((r) => { wake = r; });
      }
    },
  };
}

// One WebSocket (/v1/ws, message type "session") per page, multiplexing turns by id;
// if it cannot open, the page uses SSE.
class SessionSocket {
  constructor() { this.ws = null; this.opening = null; this.turns = new Map(); this.broken = false; }

  open() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) return Promise.resolve(this.ws);
    if (this.opening) return this.opening;
    const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/v1/ws`;
    this.opening = new Promise((resolve, reject) => {
      let ws;
      const protocols = apiKey ? ['chatserve', `chatserve.bearer.${apiKey}`] : undefined;
      try { ws = new WebSocket(url, protocols); } catch (e) { reject(e); return; }
      const timer = setTimeout(() => { ws.close(); reject(new Error('websocket open timed out')); }, 3000);
      ws.onopen = () => { clearTimeout(timer); this.ws = ws; resolve(ws); };
      ws.onerror = () => { clearTimeout(timer); reject(new Error('websocket failed')); };
      ws.onclose = () => {
        clearTimeout(timer);
        reject(new Error('websocket closed'));
        if (this.ws === ws) this.ws = null;
        for (const ch of this.turns.values()) ch.close(new Error('connection lost'));
        this.turns.clear();
      };
      ws.onmessage = (ev) => this.dispatch(ev.data);
    }).finally(() => { this.opening = null; });
    return this.opening;
  }

  reset() {
    this.broken = false;
    if (this.ws) { const ws = this.ws; this.ws = null; ws.close(); }
  }

  dispatch(raw) {
    let msg;
    try { msg = JSON.parse(raw); } catch (e) { return; }
    const ch = this.turns.get(msg.id);
    if (!ch) return;
    if (msg.type === 'chunk') ch.push(msg.chunk);
    else if (msg.type === 'done' || msg.type === 'cancelled') { this.turns.delete(msg.id); ch.close(); }
    else if (msg.type === 'error') {
      this.turns.delete(msg.id);
      ch.close(new ApiError(msg.status || 500, msg.error?.message || 'error'));
    }
  }

  async *turn(sessionId, body, control) {
    const ws = await this.open();
    const id = (crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2));
    const ch = channel();
    this.turns.set(id, ch);
    control.stop = () => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'cancel', id })); };
    ws.send(JSON.stringify({ ...body, id, type: 'session', session_id: sessionId }));
    yield* ch;
  }
}

const socket = new SessionSocket();
export const transport = { mode: 'websocket' };

async function* sseTurn(sessionId, body, control) {
  const abort = new AbortController();
  control.stop = () => {
    api.cancel(sessionId).catch(() => {});
    setTimeout(() => abort.abort(), 3000);    // the server ends the stream itself; this is a backstop
  };
  const r = await fetch(`${S}/${encodeURIComponent(sessionId)}/messages`, {
    method: 'POST', credentials: 'same-origin', signal: abort.signal,
    headers: authHeaders({ 'content-type': 'application/json', accept: 'text/event-stream' }),
    body: JSON.stringify({ ...body, stream: true }),
  });
  noteStoreHeader(r);
  if (!r.ok) throw await errorOf(r);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data: ')) continue;
          const data = line.slice(6);
          if (data === '[DONE]') return;
          yield JSON.parse(data);
        }
      }
    }
  } catch (e) {
    if (e.name !== 'AbortError') throw e;
  } finally {
    reader.releaseLock();
  }
}

// Stream one turn. `control.stop()` becomes available once it starts and cancels it on the server.
export async function* streamTurn(sessionId, body, control) {
  if (!socket.broken && new URLSearchParams(location.search).get('transport') !== 'sse') {
    let opened = false;
    try {
      await socket.open();
      opened = true;
    } catch (e) {
      socket.broken = true;
    }
    if (opened) { transport.mode = 'websocket'; yield* socket.turn(sessionId, body, control); return; }
  }
  transport.mode = 'sse';
  yield* sseTurn(sessionId, body, control);
}
