// The page: renders ChatState into the DOM and turns clicks and keys into api calls.
// Chat data lives in store.js, the network in api.js, markdown safety in render.js.
import { ChatState, formatStats, contextUsage, compactNumber, paramsFromInputs, SAMPLING_FIELDS, newChatDefaults } from './store.js';
import { api, streamTurn, attachTurn, onStoreHeader, transport, setApiKey, isNetworkError, ping } from './api.js';
import { MarkdownView } from './render.js';
import { ThinkingView, thinkingOn, withThinking } from './thinking.js';

const $ = (id) => document.getElementById(id);
const state = new ChatState();
const models = { list: [], chosen: null };     // /v1/models; `chosen` is the model for a new chat
const newChat = { thinking: true };            // the thinking switch of the chat not created yet
let stickToBottom = true;
const queued = new Set();                       // session ids with a reply render queued for the next frame

// ── theme ──────────────────────────────────────────────────────────────────────────────────
function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $('hljs-light').disabled = theme === 'dark';
  $('hljs-dark').disabled = theme !== 'dark';
  $('theme-toggle').setAttribute('aria-pressed', String(theme === 'dark'));
}
function initTheme() {
  const saved = localStorage.getItem('chatserve-theme');
  const dark = window.matchMedia && window.matchMedia('(prefers-color-scheme: dark)').matches;
  applyTheme(saved || (dark ? 'dark' : 'light'));
  $('theme-toggle').addEventListener('click', () => {
    const next = document.documentElement.dataset.theme === 'dark' ? 'light' : 'dark';
    localStorage.setItem('chatserve-theme', next);
    applyTheme(next);
  });
}

// ── small helpers ──────────────────────────────────────────────────────────────────────────
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function button(label, cls, onClick, title) {
  const b = el('button', `btn small ${cls || ''}`, label);
  b.type = 'button';
  if (title) { b.title = title; b.setAttribute('aria-label', title); }
  b.addEventListener('click', onClick);
  return b;
}
async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {
    const ta = el('textarea');
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    document.execCommand('copy');
    ta.remove();
  }
  if (btn) { const old = btn.textContent; btn.textContent = 'Copied'; setTimeout(() => { btn.textContent = old; }, 1200); }
}

// Errors stack up in their own region until dismissed: a later one never hides an earlier one.
function showError(message) {
  const box = $('errors');
  for (const item of box.children) {
    if (item.dataset.msg === message) {
      const n = Number(item.dataset.count || 1) + 1;
      item.dataset.count = String(n);
      item.querySelector('.count').textContent = ` (×${n})`;
      return;
    }
  }
  const item = el('div', 'error-item');
  item.dataset.msg = message;
  item.append(el('span', 'text', message), el('span', 'count', ''),
    button('×', 'icon dismiss', () => item.remove(), 'Dismiss this error'));
  box.appendChild(item);
  while (box.children.length > 3) box.firstElementChild.remove();
}
function showHint(message) {
  const h = $('hint');
  h.textContent = message;
  h.hidden = false;
  clearTimeout(showHint.timer);
  showHint.timer = setTimeout(() => { h.hidden = true; }, 5000);
}
function announce(text) { $('announcer').textContent = text; }

// ── connection: an offline indicator and reconnecting with backoff ──────────────────────────
const conn = { online: true, attempt: 0, timer: null };
function goOffline() {
  if (!conn.online) return;
  conn.online = false;
  conn.attempt = 0;
  document.body.classList.add('offline');
  $('conn').hidden = false;
  scheduleReconnect();
}
function scheduleReconnect() {
  const delay = Math.min(30, 2 ** conn.attempt);              // 1, 2, 4 … 30 s
  conn.attempt += 1;
  let left = delay;
  const tick = () => {
    $('conn-text').textContent = `Offline: reconnecting in ${left} s`;
    if (left-- <= 0) { tryReconnect(); return; }
    conn.timer = setTimeout(tick, 1000);
  };
  tick();
}
async function tryReconnect() {
  clearTimeout(conn.timer);
  if (conn.online) return;
  $('conn-text').textContent = 'Offline: reconnecting…';
  if (!(await ping())) { scheduleReconnect(); return; }
  conn.online = true;
  document.body.classList.remove('offline');
  $('conn').hidden = true;
  await refreshSessions();
  if (state.current && !state.busy(state.current.id)) await openSession(state.current.id);
}
function noteFailure(e) {
  if (isNetworkError(e)) { goOffline(); return true; }
  return false;
}

// ── sidebar: the session list and search ───────────────────────────────────────────────────
const search = { query: '', hits: null, cache: new Map() };     // cache: id → {updated, text}

function renderSessions() {
  const ul = $('session-list');
  ul.replaceChildren();
  const q = search.query.toLowerCase();
  for (const s of state.sessions) {
    if (q && !(s.title || '').toLowerCase().includes(q) && !(search.hits && search.hits.has(s.id))) continue;
    const li = el('li', 'session-item');
    li.dataset.id = s.id;
    const active = state.current && state.current.id === s.id;
    if (active) li.classList.add('active');
    if (state.busy(s.id)) li.classList.add('live');
    const title = el('button', 'session-title', s.title || 'New chat');
    title.type = 'button';
    if (active) title.setAttribute('aria-current', 'true');
    title.addEventListener('click', () => { openSession(s.id); closeSidebar(); });
    const rename = button('✎', 'icon rename', () => startRename(li, s), 'Rename');
    const del = button('×', 'icon delete', () => {
      if (!del.classList.contains('confirm')) {
        del.classList.add('confirm');
        del.textContent = 'Delete?';
        setTimeout(() => { del.classList.remove('confirm'); del.textContent = '×'; }, 3000);
        return;
      }
      deleteSession(s.id);
    }, 'Delete');
    if (!active) { rename.tabIndex = -1; del.tabIndex = -1; }    // shown on hover only: not in the tab order
    li.append(title, rename, del);
    ul.appendChild(li);
  }
  $('search-empty').hidden = !(q && !ul.children.length);
}

async function runSearch() {
  const q = search.query.trim().toLowerCase();
  if (!q) { search.hits = null; renderSessions(); return; }
  renderSessions();                                         // titles at once, contents as they load
  const hits = new Set();
  for (const s of state.sessions) {
    let c = search.cache.get(s.id);
    if (!c || c.updated !== s.updated) {
      try {
        const full = await api.get(s.id);
        c = { updated: s.updated, text: [full.title, full.system_prompt, ...full.messages.map((m) => m.content)].join('\n').toLowerCase() };
        search.cache.set(s.id, c);
      } catch (e) { continue; }
    }
    if (search.query.trim().toLowerCase() !== q) return;    // a newer query took over
    if (c.text.includes(q)) hits.add(s.id);
  }
  search.hits = hits;
  renderSessions();
}

function startRename(li, s) {
  const input = el('input', 'rename-input');
  input.value = s.title || '';
  input.maxLength = 200;
  input.setAttribute('aria-label', 'New title');
  li.replaceChildren(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    if (save && input.value.trim() && input.value !== s.title) {
      try {
        const upd = await api.patch(s.id, { title: input.value.trim() });
        if (state.current && state.current.id === s.id) { state.current.title = upd.title; renderHeader(); }
      } catch (e) { showError(`Rename failed: ${e.message}`); }
    }
    await refreshSessions();
  };
  input.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter') finish(true);
    if (ev.key === 'Escape') { ev.stopPropagation(); finish(false); }
  });
  input.addEventListener('blur', () => finish(true));
}

async function deleteSession(id) {
  try {
    await api.remove(id);
  } catch (e) { if (!noteFailure(e)) showError(`Delete failed: ${e.message}`); }
  if (state.current && state.current.id === id) { state.setCurrent(null); history.replaceState(null, '', location.pathname + location.search); }
  await refreshSessions();
}

async function refreshSessions() {
  try {
    state.setSessions(await api.list());
    $('key-form').hidden = true;
    return true;
  } catch (e) {
    if (e.status === 401) { askForKey(e.message); return false; }
    if (!noteFailure(e)) showError(`Could not load conversations: ${e.message}`);
    return false;
  }
}

function askForKey(why) {
  $('key-form').hidden = false;
  $('api-key').setAttribute('aria-invalid', String(why !== 'missing API key'));
  $('api-key').focus();
}

// ── the open conversation ──────────────────────────────────────────────────────────────────
function renderHeader() {
  const s = state.current;
  $('chat-title').textContent = s ? s.title : 'chatserve';
  $('export-chat').disabled = !s;
  const cu = contextUsage(s, state.maxContext);
  $('context-text').textContent = s ? (cu.max ? `${compactNumber(cu.used)} / ${compactNumber(cu.max)} tokens`
    : `${compactNumber(cu.used)} tokens`) : '';
  $('context-fill').style.width = `${Math.round((cu.frac || 0) * 100)}%`;
  $('context-meter').classList.toggle('warn', (cu.frac || 0) > 0.85);
  $('context-meter').hidden = !s;
  renderModel();
}

function renderModel() {
  const name = (state.current && state.current.model) || models.chosen || (models.list[0] && models.list[0].id) || '';
  $('model-name').textContent = name;
  $('model-name').hidden = !name || models.list.length > 1;
  const pick = $('model-picker');
  pick.hidden = models.list.length <= 1;
  if (!pick.hidden) pick.value = name;
}

function renderMessages() {
  const box = $('messages');
  const msgs = state.current ? state.current.messages : [];
  box.querySelectorAll('.msg').forEach((n) => n.remove());
  $('empty').hidden = msgs.length > 0;
  msgs.forEach((m, i) => box.appendChild(messageNode(m, i, i === msgs.length - 1)));
  setBusy();
  scrollIfStuck();
}

function messageNode(m, index, isLast) {
  const node = $('tpl-message').content.firstElementChild.cloneNode(true);
  node.classList.add(m.role);
  node.dataset.index = String(index);
  const who = m.role === 'user' ? 'You' : m.role === 'assistant' ? 'Assistant' : 'System';
  node.setAttribute('aria-label', `${who}, message ${index + 1}`);
  const body = node.querySelector('.msg-body');
  if (m.role === 'assistant') {
    node.thinking = new ThinkingView(body, copyText);
    node.thinking.update(m);
    node.view = new MarkdownView(body, copyText);
    node.view.update(m.content, !!m.streaming);
    if (m.streaming) { node.classList.add('streaming'); node.setAttribute('aria-busy', 'true'); }
  } else {
    body.textContent = m.content;              // user text is shown as typed, never as HTML
  }
  fillFoot(node, m, index, isLast);
  return node;
}

function fillFoot(node, m, index, isLast) {
  const stats = node.querySelector('.stats');
  stats.replaceChildren();
  if (m.streaming && m.progress && !m.content) stats.appendChild(progressNode(m.progress));
  for (const [k, text] of formatStats(m.usage)) stats.appendChild(el('span', `stat stat-${k}`, text));
  if (m.finish_reason === 'abort') stats.appendChild(el('span', 'stat stopped', 'stopped'));
  if (m.finish_reason === 'length') stats.appendChild(el('span', 'stat', 'max tokens'));
  if (m.finish_reason === 'interrupted' && !m.error) stats.appendChild(el('span', 'stat error', 'interrupted'));
  if (m.error) stats.appendChild(el('span', 'stat error', m.error));
  if (m.pending) stats.appendChild(el('span', 'stat', 'sending…'));
  const tools = node.querySelector('.tools');
  tools.replaceChildren();
  if (m.streaming) return;
  const busy = state.replying;
  if (Array.isArray(m.versions) && m.versions.length > 1) tools.appendChild(pager(m));
  tools.appendChild(button('Copy', 'copy', (ev) => copyText(m.content, ev.currentTarget), 'Copy message'));
  if (busy) return;
  if (m.role === 'user') tools.appendChild(button('Edit', 'edit', () => startEdit(node, m, index), 'Edit and resend'));
  if (m.role === 'user' && isLast) tools.appendChild(button('Retry', 'retry', () => sendTurn({ regenerate: true }), 'Answer this message'));
  if (m.role === 'assistant' && isLast) tools.appendChild(button('Regenerate', 'regenerate', () => sendTurn({ regenerate: true }), 'Regenerate'));
}

function progressNode(p) {
  const span = el('span', 'stat progress');
  if (p.phase === 'loading-model') span.textContent = 'loading model…';
  else if (p.phase === 'queued') span.textContent = `queued: position ${p.queue_position}`;
  else if (p.phase === 'prefill' && p.prefill_total) {
    const pct = Math.floor((100 * p.prefill_done) / p.prefill_total);
    span.textContent = `reading the prompt: ${p.prefill_done} / ${p.prefill_total} tokens (${pct}%)`;
    const bar = el('progress', 'prefill-bar');
    bar.max = p.prefill_total;
    bar.value = p.prefill_done;
    bar.setAttribute('aria-label', 'Prompt processing');
    span.appendChild(bar);
  } else span.textContent = p.phase || '';
  return span;
}

// ◀ n/N ▶: switch the active branch of this message on the server.
function pager(m) {
  const box = el('span', 'pager');
  const i = m.version ?? m.versions.indexOf(m.id);
  const go = (j) => async () => {
    if (!state.current || state.replying) return;
    try { state.setCurrent(await api.branch(state.current.id, m.versions[j])); } catch (e) {
      if (!noteFailure(e)) showError(`Could not switch versions: ${e.message}`);
    }
  };
  const prev = button('◀', 'icon prev', go(i - 1), 'Previous version');
  const next = button('▶', 'icon next', go(i + 1), 'Next version');
  prev.disabled = i <= 0;
  next.disabled = i >= m.versions.length - 1;
  box.append(prev, el('span', 'pager-text', `${i + 1}/${m.versions.length}`), next);
  return box;
}

function startEdit(node, m, index) {
  if (state.replying) return;
  const body = node.querySelector('.msg-body');
  const ta = el('textarea', 'edit-box');
  ta.value = m.content;
  ta.rows = Math.min(12, Math.max(2, m.content.split('\n').length + 1));
  ta.setAttribute('aria-label', 'Edit message (Enter sends, Escape cancels)');
  const send = () => { const t = ta.value.trim(); if (t) sendTurn({ content: t, replace_from: index }); };
  ta.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    if (ev.key === 'Escape') { ev.preventDefault(); ev.stopPropagation(); renderMessages(); $('input').focus(); }
  });
  const bar = el('div', 'edit-bar');
  bar.append(button('Send', 'primary edit-send', send), button('Cancel', 'edit-cancel', () => renderMessages()));
  body.replaceChildren(ta, bar);
  node.querySelector('.tools').replaceChildren();
  ta.focus();
}

// Streaming: re-render only the streaming bubble of the chat on screen, at most once per frame.
function queueReplyRender(sid) {
  if (queued.has(sid)) return;
  queued.add(sid);
  requestAnimationFrame(() => {
    queued.delete(sid);
    if (!state.current || state.current.id !== sid) return;
    const r = state.replyOf(sid);
    const nodes = $('messages').querySelectorAll('.msg');
    const node = nodes[nodes.length - 1];
    if (!r || !node || !node.view) return;
    node.thinking.update(r);
    node.view.update(r.content, true);
    fillFoot(node, r, nodes.length - 1, true);
    scrollIfStuck();
  });
}

async function openSession(id, { settle = false, follow = true } = {}) {
  if (state.busy(id)) {                                   // a chat this tab is streaming into: its live object
    state.setCurrent({ id });
    history.replaceState(null, '', `#${id}`);
    return;
  }
  try {
    let s = await api.get(id);
    // right after a stream ends the server may still be saving the reply: wait for it briefly
    for (let i = 0; settle && s.generating && i < 25; i++) {
      await new Promise((r) => { setTimeout(r, 120); });
      s = await api.get(id);
    }
    if (state.busy(id)) return;
    state.setCurrent(s);
    if (location.hash.slice(1) !== id) history.replaceState(null, '', `#${id}`);
    if (s.generating && follow) attach(state.current);
  } catch (e) {
    if (e.status === 404) { state.setCurrent(null); history.replaceState(null, '', location.pathname + location.search); }
    else if (!noteFailure(e)) showError(`Could not open the conversation: ${e.message}`);
  }
}

// The server is still writing a reply in this session (a reload, or the connection dropped): follow it.
async function attach(session) {
  const sid = session.id;
  const control = {};
  state.attachReply(session, control);
  let failed = null;
  try {
    for await (const item of attachTurn(sid, control)) state.applyItem(sid, item);
  } catch (e) { failed = e; }
  state.endReply(sid, failed && isNetworkError(failed) ? 'connection lost' : null);
  if (failed && noteFailure(failed)) return;
  await finishTurn(sid, failed && ![400, 404, 405].includes(failed.status) ? failed : null, { wait: !!failed, follow: false });
}

async function ensureSession() {
  if (state.current) return state.current;
  const { params, errors } = settingsFromPanel();
  if (Object.keys(errors).length) throw new Error('the settings have errors');
  const body = { system_prompt: $('system-prompt').value, params: withThinking(params, newChat.thinking) };
  if (models.chosen) body.model = models.chosen;
  const s = await api.create(body);
  newChat.thinking = true;                              // the switch was this chat's; the next starts on
  state.setCurrent(s);
  history.replaceState(null, '', `#${s.id}`);
  state.setSessions([{ id: s.id, title: s.title, created: s.created, updated: s.updated }, ...state.sessions.filter((x) => x.id !== s.id)]);
  return state.current;
}

async function sendTurn(body, sentText = null) {
  if (state.replying) { showHint('A reply is still being written in this chat: press Esc or Stop first.'); return; }
  if (!conn.online) { showError('The server is unreachable: your message is kept; send it again when back online.'); return; }
  let session;
  try { session = await ensureSession(); } catch (e) {
    if (!noteFailure(e)) showError(`Could not start a chat: ${e.message}`);
    return;
  }
  const sid = session.id;
  const control = {
    taken: false,
    accepted: () => {
      control.taken = true;
      state.accepted(sid);
      if (sentText !== null && $('input').value.trim() === sentText) { $('input').value = ''; growInput(); saveDraft(); }
    },
  };
  const reply = state.startReply(session, body, control);
  if (!modelLoaded(session.model)) {               // its first token waits for the load: say so
    reply.progress = { object: 'chatserve.turn.progress', phase: 'loading-model' };
    renderMessages();
  }
  stickToBottom = true;
  let failed = null;
  try {
    for await (const item of streamTurn(sid, body, control)) state.applyItem(sid, item);
  } catch (e) { failed = e; }
  state.endReply(sid, failed ? (isNetworkError(failed) ? 'connection lost' : failed.message) : null);
  document.body.dataset.transport = transport.mode;
  if (failed && noteFailure(failed)) {
    if (!control.taken) showError('Connection lost before the server took the message: it is still in the box.');
    return;
  }
  await finishTurn(sid, failed);
  if (!modelLoaded(session.model)) loadModelInfo();    // it is loaded now (or another one was unloaded)
}

// Whether the server has this model in memory (/v1/models `status`; a server that says nothing: yes).
function modelLoaded(name) {
  const m = models.list.find((x) => x.id === name) || (!name && models.list[0]);
  return !m || !m.status || m.status === 'loaded';
}

async function finishTurn(sid, failed, { wait = true, follow = true } = {}) {
  if (failed) showError(`The reply failed: ${failed.message}`);
  else {
    const s = state.current && state.current.id === sid ? state.current : null;
    const last = s && s.messages[s.messages.length - 1];
    if (last && last.role === 'assistant') announce(`Reply finished: ${last.content.slice(0, 300)}`);
  }
  if (state.current && state.current.id === sid) await openSession(sid, { settle: wait, follow });
  await refreshSessions();
}

function stopCurrent() {
  const sid = state.current && state.current.id;
  const live = sid && state.live.get(sid);
  if (!live) return;
  $('stop').disabled = true;
  api.cancel(sid).catch(() => {});
  setTimeout(() => {                         // backstop: stop following if the server never ends it
    if (state.live.get(sid) === live && live.control.detach) live.control.detach();
  }, 5000);
}

function setBusy() {
  const busy = state.replying;
  $('send').hidden = busy;
  $('stop').hidden = !busy;
  if (!busy) $('stop').disabled = false;
  document.body.classList.toggle('busy', busy);
}

// ── settings panel ──────────────────────────────────────────────────────────────────────────
function settingsFromPanel() {
  const values = {};
  for (const k of Object.keys(SAMPLING_FIELDS)) values[k] = $(`p-${k}`).validity.badInput ? 'x' : $(`p-${k}`).value;
  return paramsFromInputs(values, { maxContext: state.maxContext });
}
function showFieldErrors(errors) {
  for (const k of Object.keys(SAMPLING_FIELDS)) {
    const input = $(`p-${k}`);
    const msg = $(`err-${k}`);
    input.setAttribute('aria-invalid', String(!!errors[k]));
    msg.textContent = errors[k] || '';
    msg.hidden = !errors[k];
  }
}
function renderSettings() {
  const s = state.current;
  $('system-prompt').value = s ? s.system_prompt || '' : '';       // a new chat starts from the default
  const start = s ? s.params || {} : newChatDefaults(currentModel());
  for (const k of Object.keys(SAMPLING_FIELDS)) $(`p-${k}`).value = start[k] != null ? start[k] : '';
  showFieldErrors({});
  renderThinkingToggle();
}
async function saveSettings() {
  const { params, errors } = settingsFromPanel();
  showFieldErrors(errors);
  if (Object.keys(errors).length) {
    $(`p-${Object.keys(errors)[0]}`).focus();
    return;
  }
  try {
    if (state.current) {
      const keep = state.current.params && state.current.params.reasoning_effort;
      const all = keep ? { ...params, reasoning_effort: keep } : params;
      const s = await api.patch(state.current.id, { system_prompt: $('system-prompt').value, params: all });
      state.current.system_prompt = s.system_prompt;
      state.current.params = s.params;
    } else {
      await ensureSession();
    }
    $('save-settings').textContent = 'Saved';
    setTimeout(() => { $('save-settings').textContent = 'Save'; }, 1200);
    await refreshSessions();
  } catch (e) { if (!noteFailure(e)) showError(`Settings not saved: ${e.message}`); }
}

// ── the thinking switch: per chat, shown where the model's template has one ──────────────────
function currentModel() {
  const name = (state.current && state.current.model) || models.chosen;
  return models.list.find((x) => x.id === name) || models.list[0] || null;
}
function renderThinkingToggle() {
  const m = currentModel();
  const btn = $('thinking-toggle');
  btn.hidden = !(m && m.thinking_switch);
  const on = state.current ? thinkingOn(state.current.params) : newChat.thinking;
  btn.setAttribute('aria-pressed', String(on));
  btn.textContent = on ? 'Thinking: on' : 'Thinking: off';
}
async function toggleThinking() {
  if (!state.current) { newChat.thinking = !newChat.thinking; renderThinkingToggle(); return; }
  // The switch flips at once (the click is the user's answer); a refused save puts it back.
  const chat = state.current;
  const before = chat.params;
  chat.params = withThinking(before, !thinkingOn(before));
  renderThinkingToggle();
  let saved = before;
  try {
    saved = (await api.patch(chat.id, { params: chat.params })).params;
  } catch (e) {
    if (!noteFailure(e)) showError(`Could not switch thinking: ${e.message}`);
  }
  chat.params = saved;
  if (state.current && state.current.id === chat.id) {
    state.current.params = saved;
    renderThinkingToggle();
  }
}

// ── the store notice ────────────────────────────────────────────────────────────────────────
function renderNotice() {
  const st = state.storeStatus;
  const box = $('notice');
  box.className = 'notice';
  if (st && st.degraded) {
    box.hidden = false;
    box.classList.add('warn');
    box.textContent = 'Session storage is unreachable. Chatting still works; '
      + `${st.pending_writes || 0} change(s) will be saved when it is back.`;
  } else if (st && st.persistent === false) {
    box.hidden = false;
    box.classList.add('info');
    box.textContent = 'Conversations are kept in server memory only and are lost when the server restarts.';
  } else {
    box.hidden = true;
    box.textContent = '';
  }
}
async function pollStatus() {
  try { state.setStoreStatus(await api.status()); } catch (e) { noteFailure(e); }
  const degraded = state.storeStatus && state.storeStatus.degraded;
  setTimeout(pollStatus, degraded ? 2000 : 10000);
}
onStoreHeader((v) => {
  const st = state.storeStatus;
  if ((v === 'degraded') !== !!(st && st.degraded)) api.status().then((s) => state.setStoreStatus(s)).catch(() => {});
});

// ── scrolling ───────────────────────────────────────────────────────────────────────────────
function scrollIfStuck() {
  const box = $('messages');
  if (stickToBottom) box.scrollTop = box.scrollHeight;
  $('jump-bottom').hidden = stickToBottom;
}
function initScroll() {
  const box = $('messages');
  let lastTop = 0;
  box.addEventListener('scroll', () => {
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    if (box.scrollTop < lastTop - 2 && !atBottom) stickToBottom = false;   // the user scrolled up
    else if (atBottom) stickToBottom = true;
    lastTop = box.scrollTop;
    $('jump-bottom').hidden = stickToBottom;
  }, { passive: true });
  $('jump-bottom').addEventListener('click', () => { stickToBottom = true; scrollIfStuck(); });
}

// ── phone drawer ────────────────────────────────────────────────────────────────────────────
function openSidebar() { $('sidebar').classList.add('open'); $('scrim').hidden = false; }
function closeSidebar() { $('sidebar').classList.remove('open'); $('scrim').hidden = true; }

// ── the composer: its draft survives a reload until the server has the message ─────────────
function growInput() {
  const input = $('input');
  input.style.height = 'auto';
  input.style.height = `${Math.min(200, input.scrollHeight)}px`;
}
function saveDraft() {
  const v = $('input').value;
  if (v) sessionStorage.setItem('chatserve-draft', v); else sessionStorage.removeItem('chatserve-draft');
}

// ── wiring ──────────────────────────────────────────────────────────────────────────────────
function wire() {
  const input = $('input');
  input.value = sessionStorage.getItem('chatserve-draft') || '';
  input.addEventListener('input', () => { growInput(); saveDraft(); });
  input.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $('composer').requestSubmit(); }
  });
  $('composer').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text) { input.focus(); return; }
    sendTurn({ content: text }, text);
  });
  $('stop').addEventListener('click', stopCurrent);
  document.addEventListener('keydown', (ev) => {
    if (ev.key === 'Escape' && !ev.defaultPrevented && state.replying) { ev.preventDefault(); stopCurrent(); }
  });
  $('new-chat').addEventListener('click', () => {
    state.setCurrent(null);
    history.replaceState(null, '', location.pathname + location.search);
    closeSidebar();
    input.focus();
  });
  $('toggle-settings').addEventListener('click', () => {
    const open = $('settings').hidden;
    $('settings').hidden = !open;
    $('toggle-settings').setAttribute('aria-expanded', String(open));
  });
  $('save-settings').addEventListener('click', saveSettings);
  $('thinking-toggle').addEventListener('click', toggleThinking);
  $('export-chat').addEventListener('click', () => {
    if (!state.current) return;
    const a = el('a');
    a.href = api.exportUrl(state.current.id);
    a.download = '';
    document.body.appendChild(a);
    a.click();
    a.remove();
  });
  $('import-chat').addEventListener('click', () => $('import-file').click());
  $('import-file').addEventListener('change', async (ev) => {
    const file = ev.target.files[0];
    ev.target.value = '';
    if (!file) return;
    try {
      const s = await api.importDoc(JSON.parse(await file.text()));
      await refreshSessions();
      await openSession(s.id);
    } catch (e) { if (!noteFailure(e)) showError(`Import failed: ${e.message}`); }
  });
  let searchTimer = null;
  $('search').addEventListener('input', () => {
    search.query = $('search').value;
    search.hits = null;
    renderSessions();
    clearTimeout(searchTimer);
    searchTimer = setTimeout(runSearch, 200);
  });
  $('model-picker').addEventListener('change', async () => {
    const m = $('model-picker').value;
    models.chosen = m;
    if (!state.current) { renderModel(); return; }
    try {
      const s = await api.patch(state.current.id, { model: m });
      state.current.model = s.model;
      renderModel();
    } catch (e) { if (!noteFailure(e)) showError(`Could not switch models: ${e.message}`); }
  });
  $('chat-title').addEventListener('dblclick', () => {
    const li = document.querySelector(`.session-item[data-id="${CSS.escape(state.current?.id || '')}"]`);
    const s = state.sessions.find((x) => x.id === state.current?.id);
    if (li && s) startRename(li, s);
  });
  $('key-form').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    setApiKey($('api-key').value.trim());
    $('api-key').value = '';
    if (await refreshSessions()) {
      const id = location.hash.slice(1);
      if (id) await openSession(id);
      loadModelInfo();
    }
  });
  $('conn-retry').addEventListener('click', tryReconnect);
  $('open-sidebar').addEventListener('click', openSidebar);
  $('close-sidebar').addEventListener('click', closeSidebar);
  $('scrim').addEventListener('click', closeSidebar);
  window.addEventListener('offline', goOffline);
  window.addEventListener('online', () => { if (!conn.online) tryReconnect(); });
  window.addEventListener('hashchange', () => {
    const id = location.hash.slice(1);
    if (id && (!state.current || state.current.id !== id)) openSession(id);
  });

  state.addEventListener('change', (ev) => {
    const { what, sid } = ev.detail;
    const here = state.current && sid === state.current.id;
    switch (what) {
      case 'sessions': renderSessions(); break;
      case 'current': renderHeader(); renderMessages(); renderSettings(); renderSessions(); break;
      case 'reply-start': if (here) renderMessages(); renderSessions(); break;
      case 'accepted': if (here) renderMessages(); break;
      case 'reply-delta': if (here) queueReplyRender(sid); break;
      case 'reply-end': if (here) { renderMessages(); renderHeader(); } renderSessions(); break;
      case 'status': renderNotice(); break;
      default: break;
    }
  });
}

async function loadModelInfo() {
  models.list = await api.models();
  const m = models.list[0];
  if (m) {
    state.maxContext = m.max_model_len || m.context_length || null;
    if (state.maxContext) {
      $('p-max_tokens').placeholder = `rest of context (≤ ${state.maxContext})`;
      $('p-max_tokens').max = String(state.maxContext);
    }
  }
  const pick = $('model-picker');
  pick.replaceChildren(...models.list.map((x) => {
    const o = el('option', '', x.status && x.status !== 'loaded' ? `${x.id} (not loaded)` : x.id);
    o.value = x.id;
    return o;
  }));
  renderHeader();
  if (!state.current) renderSettings();             // a new chat starts from the model's defaults
  else renderThinkingToggle();
}

async function main() {
  initTheme();
  initScroll();
  wire();
  growInput();
  const ok = await refreshSessions();
  const id = location.hash.slice(1);
  if (ok && id) await openSession(id);
  else renderHeader();
  await loadModelInfo();
  pollStatus();
  document.body.dataset.ready = '1';
}

main();
