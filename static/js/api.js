// Talking to the server: the session REST API and reply streaming (WebSocket first, SSE fallback).
// Streams are async generators of the server's items: chat.completion.chunk objects and chatserve.turn*
// events (dispatch on `object`); an in-stream error ends the generator with an ApiError. No DOM here.

import { sseEvents } from './sse.js';

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

const storeListeners = new Set();
export function onStoreHeader(fn) { storeListeners.add(fn); }
function noteStoreHeader(r) {
  const v = r.headers.get('x-chatserve-session-store');
  if (v) for (const fn of storeListeners) fn(v);
}

// The server could not be reached at all (fetch() rejected, or a stream was cut).
export function isNetworkError(e) { return e?.network === true; }
function lostError(message) { const e = new ApiError(0, message); e.network = true; return e; }

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
  let r;
  try { r = await fetch(url, init); } catch (e) { throw lostError(`cannot reach the server (${e.message})`); }
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
  branch: (id, messageId) => call('POST', `${S}/${encodeURIComponent(id)}/branch`, { message_id: messageId }),
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

// An item that carries {"error": {...}} ends the stream with that error (both transports).
function streamError(err) {
  const e = new ApiError(err?.status || (err?.code === 'shutting_down' ? 503 : 500), err?.message || 'generation failed');
  e.code = err?.code;
  return e;
}

// One WebSocket (/v1/ws) per page, multiplexing turns by id. When it cannot open, the page uses SSE
// for a while and tries the WebSocket again later (backoff from 2 s to 60 s), never giving up for good.
class SessionSocket {
  constructor() { this.ws = null; this.opening = null; this.turns = new Map(); this.retryAt = 0; this.backoff = 0; }

  get usable() { return Date.now() >= this.retryAt; }

  failed() {
    this.backoff = Math.min(60000, this.backoff ? this.backoff * 2 : 2000);
    this.retryAt = Date.now() + this.backoff;
  }

  open() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) return Promise.resolve(this.ws);
    if (this.opening) return this.opening;
    const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/v1/ws`;
    this.opening = new Promise((resolve, reject) => {
      let ws;
      const protocols = apiKey ? ['chatserve', `chatserve.bearer.${apiKey}`] : undefined;
      try { ws = new WebSocket(url, protocols); } catch (e) { reject(e); return; }
      const timer = setTimeout(() => { ws.close(); reject(new Error('websocket open timed out')); }, 3000);
      ws.onopen = () => { clearTimeout(timer); this.ws = ws; this.backoff = 0; this.retryAt = 0; resolve(ws); };
      ws.onerror = () => { clearTimeout(timer); reject(new Error('websocket failed')); };
      ws.onclose = () => {
        clearTimeout(timer);
        reject(new Error('websocket closed'));
        if (this.ws === ws) this.ws = null;
        for (const ch of this.turns.values()) ch.close(lostError('connection lost'));
        this.turns.clear();
      };
      ws.onmessage = (ev) => this.dispatch(ev.data);
    }).catch((e) => { this.failed(); throw e; }).finally(() => { this.opening = null; });
    return this.opening;
  }

  reset() {
    this.retryAt = 0;
    this.backoff = 0;
    if (this.ws) { const ws = this.ws; this.ws = null; ws.close(); }
  }

  dispatch(raw) {
    let msg;
    try { msg = JSON.parse(raw); } catch (e) { return; }
    const ch = this.turns.get(msg.id);
    if (!ch) return;
    if (msg.type === 'chunk') {
      if (msg.chunk && msg.chunk.error) { this.turns.delete(msg.id); ch.close(streamError(msg.chunk.error)); }
      else ch.push(msg.chunk);
    } else if (msg.type === 'done' || msg.type === 'cancelled') { this.turns.delete(msg.id); ch.close(); }
    else if (msg.type === 'error') {
      this.turns.delete(msg.id);
      ch.close(streamError({ ...msg.error, status: msg.status || 500 }));
    }
  }

  async *request(payload, control) {
    const ws = await this.open();
    const id = (crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2));
    const ch = channel();
    this.turns.set(id, ch);
    control.detach = () => {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'cancel', id }));
      this.turns.delete(id);
      ch.close();
    };
    ws.send(JSON.stringify({ ...payload, id }));
    let first = true;
    for await (const item of ch) {
      if (first) { first = false; if (control.accepted) control.accepted(); }
      yield item;
    }
  }
}

const socket = new SessionSocket();
export const transport = { mode: 'websocket' };

async function* sseRequest(url, body, control) {
  const abort = new AbortController();
  control.detach = () => abort.abort();
  let r;
  try {
    r = await fetch(url, {
      method: 'POST', credentials: 'same-origin', signal: abort.signal,
      headers: authHeaders({ 'content-type': 'application/json', accept: 'text/event-stream' }),
      body: JSON.stringify(body),
    });
  } catch (e) {
    if (e.name === 'AbortError') return;
    throw lostError(`cannot reach the server (${e.message})`);
  }
  noteStoreHeader(r);
  if (!r.ok) throw await errorOf(r);
  if (control.accepted) control.accepted();
  try {
    for await (const ev of sseEvents(r.body)) {
      if (ev.data === '[DONE]') return;
      let item;
      try { item = JSON.parse(ev.data); } catch (e) { continue; }
      if (ev.event === 'error' || (item && item.error)) throw streamError(item.error || item);
      yield item;
    }
    throw lostError('the stream ended before [DONE]');
  } catch (e) {
    if (e.name === 'AbortError') return;
    if (e instanceof ApiError) throw e;
    throw lostError(`connection lost (${e.message})`);
  }
}

function wantWebSocket() {
  return new URLSearchParams(location.search).get('transport') !== 'sse' && socket.usable;
}

async function* stream(wsPayload, sseUrl, sseBody, control) {
  if (wantWebSocket()) {
    let opened = false;
    try { await socket.open(); opened = true; } catch (e) { /* SSE this time; the socket is retried later */ }
    if (opened) { transport.mode = 'websocket'; yield* socket.request(wsPayload, control); return; }
  }
  transport.mode = 'sse';
  yield* sseRequest(sseUrl, sseBody, control);
}

// Stream one turn. control.accepted() is called once the server took it; control.detach() stops
// following it (the reply may go on on the server); Stop is api.cancel(sessionId).
export function streamTurn(sessionId, body, control) {
  const sid = encodeURIComponent(sessionId);
  return stream({ ...body, type: 'session', session_id: sessionId }, `${S}/${sid}/messages`,
    { ...body, stream: true }, control);
}

// Follow a turn that is already generating (after a reload or a dropped connection).
export function attachTurn(sessionId, control) {
  const sid = encodeURIComponent(sessionId);
  return stream({ type: 'session.attach', session_id: sessionId }, `${S}/${sid}/attach`, {}, control);
}

// Is the server there? (used by the reconnect loop)
export async function ping() {
  try {
    const r = await fetch(`${S}/status`, { credentials: 'same-origin', headers: authHeaders(), cache: 'no-store' });
    return r.status < 500 || r.status === 503;
  } catch (e) { return false; }
}
