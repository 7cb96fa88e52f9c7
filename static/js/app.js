// The page: renders ChatState into the DOM and turns clicks and keys into api calls.
// Chat data lives in store.js, the network in api.js, markdown safety in render.js.
import { ChatState, formatStats, contextUsage, compactNumber, paramsFromInputs, SAMPLING_FIELDS } from './store.js';
import { api, streamTurn, onStoreHeader, transport, setApiKey } from './api.js';
import { renderMarkdown, finishCode } from './render.js';

const $ = (id) => document.getElementById(id);
const state = new ChatState();
const control = { stop: null };          // the running turn's stop(), set by the transport
let stickToBottom = true;
let renderQueued = false;

// ── theme ──────────────────────────────────────────────────────────────────────────────────
function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $('hljs-light').disabled = theme === 'dark';
  $('hljs-dark').disabled = theme !== 'dark';
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
function showError(message) {
  const box = $('notice');
  box.hidden = false;
  box.className = 'notice error';
  box.textContent = message;
  clearTimeout(showError.timer);
  showError.timer = setTimeout(() => renderNotice(), 6000);
}

// ── sidebar: the session list ──────────────────────────────────────────────────────────────
function renderSessions() {
  const ul = $('session-list');
  ul.replaceChildren();
  for (const s of state.sessions) {
    const li = el('li', 'session-item');
    li.dataset.id = s.id;
    if (state.current && state.current.id === s.id) li.classList.add('active');
    const title = el('button', 'session-title', s.title || 'New chat');
    title.type = 'button';
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
    li.append(title, rename, del);
    ul.appendChild(li);
  }
}

function startRename(li, s) {
  const input = el('input', 'rename-input');
  input.value = s.title || '';
  input.maxLength = 200;
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
    if (ev.key === 'Escape') finish(false);
  });
  input.addEventListener('blur', () => finish(true));
}

async function deleteSession(id) {
  try {
    await api.remove(id);
  } catch (e) { showError(`Delete failed: ${e.message}`); }
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
    showError(`Could not load conversations: ${e.message}`);
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
}

function renderMessages() {
  const box = $('messages');
  const msgs = state.current ? state.current.messages : [];
  box.querySelectorAll('.msg').forEach((n) => n.remove());
  $('empty').hidden = msgs.length > 0;
  msgs.forEach((m, i) => box.appendChild(messageNode(m, i, i === msgs.length - 1)));
  scrollIfStuck();
}

function messageNode(m, index, isLast) {
  const node = $('tpl-message').content.firstElementChild.cloneNode(true);
  node.classList.add(m.role);
  node.dataset.index = String(index);
  const body = node.querySelector('.msg-body');
  if (m.role === 'assistant') {
    renderMarkdown(body, m.content);
    if (!m.streaming) finishCode(body, copyText);
    if (m.streaming) node.classList.add('streaming');
  } else {
    body.textContent = m.content;              // user text is shown as typed, never as HTML
  }
  fillFoot(node, m, index, isLast);
  return node;
}

function fillFoot(node, m, index, isLast) {
  const stats = node.querySelector('.stats');
  stats.replaceChildren();
  for (const [k, text] of formatStats(m.usage)) stats.appendChild(el('span', `stat stat-${k}`, text));
  if (m.finish_reason === 'abort') stats.appendChild(el('span', 'stat stopped', 'stopped'));
  if (m.finish_reason === 'length') stats.appendChild(el('span', 'stat', 'max tokens'));
  if (m.error) stats.appendChild(el('span', 'stat error', m.error));
  const tools = node.querySelector('.tools');
  tools.replaceChildren();
  if (m.streaming) return;
  tools.appendChild(button('Copy', 'copy', (ev) => copyText(m.content, ev.currentTarget), 'Copy message'));
  if (m.role === 'user') tools.appendChild(button('Edit', 'edit', () => startEdit(node, m, index), 'Edit and resend'));
  if (m.role === 'user' && isLast) tools.appendChild(button('Retry', 'retry', () => sendTurn({ regenerate: true }), 'Answer this message'));
  if (m.role === 'assistant' && isLast) tools.appendChild(button('Regenerate', 'regenerate', () => sendTurn({ regenerate: true }), 'Regenerate'));
}

function startEdit(node, m, index) {
  if (state.replying) return;
  const body = node.querySelector('.msg-body');
  const ta = el('textarea', 'edit-box');
  ta.value = m.content;
  ta.rows = Math.min(12, Math.max(2, m.content.split('\n').length + 1));
  const bar = el('div', 'edit-bar');
  bar.append(
    button('Send', 'primary edit-send', () => { const t = ta.value.trim(); if (t) sendTurn({ content: t, replace_from: index }); }),
    button('Cancel', '', () => renderMessages()),
  );
  body.replaceChildren(ta, bar);
  node.querySelector('.tools').replaceChildren();
  ta.focus();
}

// Streaming: re-render only the last bubble, at most once per frame.
function queueReplyRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    const r = state.reply;
    const nodes = $('messages').querySelectorAll('.msg');
    const node = nodes[nodes.length - 1];
    if (!r || !node) return;
    renderMarkdown(node.querySelector('.msg-body'), r.content);
    fillFoot(node, r, nodes.length - 1, true);
    scrollIfStuck();
  });
}

async function openSession(id, { settle = false } = {}) {
  try {
    let s = await api.get(id);
    // right after a stream ends the server may still be saving the reply: wait for it briefly
    for (let i = 0; settle && s.generating && i < 25; i++) {
      await new Promise((r) => { setTimeout(r, 120); });
      s = await api.get(id);
    }
    state.setCurrent(s);
    if (location.hash.slice(1) !== id) history.replaceState(null, '', `#${id}`);
  } catch (e) {
    if (e.status === 404) { state.setCurrent(null); history.replaceState(null, '', location.pathname + location.search); }
    else showError(`Could not open the conversation: ${e.message}`);
  }
}

async function ensureSession() {
  if (state.current) return state.current.id;
  const s = await api.create(settingsFromPanel());
  state.setCurrent(s);
  history.replaceState(null, '', `#${s.id}`);
  return s.id;
}

async function sendTurn(body) {
  if (state.replying) return;
  let sid;
  try { sid = await ensureSession(); } catch (e) { showError(`Could not start a chat: ${e.message}`); return; }
  state.startReply(body);
  setBusy(true);
  stickToBottom = true;
  try {
    for await (const chunk of streamTurn(sid, body, control)) state.applyChunk(chunk);
  } catch (e) {
    const r = state.reply;
    if (r) r.error = e.message;
    showError(`The reply failed: ${e.message}`);
  } finally {
    control.stop = null;
    document.body.dataset.transport = transport.mode;
    state.endReply();
    setBusy(false);
    const stillHere = state.current && state.current.id === sid;
    if (stillHere) await openSession(sid, { settle: true });   // the stored turn, with its usage record
    await refreshSessions();
  }
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
  $('stop').disabled = false;
  document.body.classList.toggle('busy', busy);
}

// ── settings panel ──────────────────────────────────────────────────────────────────────────
function settingsFromPanel() {
  const values = {};
  for (const k of Object.keys(SAMPLING_FIELDS)) values[k] = $(`p-${k}`).value;
  return { system_prompt: $('system-prompt').value, params: paramsFromInputs(values) };
}
function renderSettings() {
  const s = state.current;
  $('system-prompt').value = s ? s.system_prompt || '' : $('system-prompt').value;
  if (s) for (const k of Object.keys(SAMPLING_FIELDS)) $(`p-${k}`).value = s.params && s.params[k] != null ? s.params[k] : '';
}
async function saveSettings() {
  try {
    const body = settingsFromPanel();
    if (state.current) {
      const s = await api.patch(state.current.id, body);
      state.current.system_prompt = s.system_prompt;
      state.current.params = s.params;
    } else {
      await ensureSession();
    }
    $('save-settings').textContent = 'Saved';
    setTimeout(() => { $('save-settings').textContent = 'Save'; }, 1200);
    await refreshSessions();
  } catch (e) { showError(`Settings not saved: ${e.message}`); }
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
  try { state.setStoreStatus(await api.status()); } catch (e) { /* the server itself is away */ }
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

// ── wiring ──────────────────────────────────────────────────────────────────────────────────
function wire() {
  const input = $('input');
  const grow = () => { input.style.height = 'auto'; input.style.height = `${Math.min(200, input.scrollHeight)}px`; };
  input.addEventListener('input', grow);
  input.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $('composer').requestSubmit(); }
  });
  $('composer').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || state.replying) return;
    input.value = '';
    grow();
    sendTurn({ content: text });
  });
  $('stop').addEventListener('click', () => { $('stop').disabled = true; if (control.stop) control.stop(); });
  $('new-chat').addEventListener('click', () => {
    if (state.replying) return;
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
  $('export-chat').addEventListener('click', () => {
    if (!state.current) return;
    const a = el('a');
    a.href = api.exportUrl(state.current.id);
    a.download = '';
    document.body.appendChild(a);
    a.click();
    a.remove();
  });
  $('import-file').addEventListener('change', async (ev) => {
    const file = ev.target.files[0];
    ev.target.value = '';
    if (!file) return;
    try {
      const s = await api.importDoc(JSON.parse(await file.text()));
      await refreshSessions();
      await openSession(s.id);
    } catch (e) { showError(`Import failed: ${e.message}`); }
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
  $('open-sidebar').addEventListener('click', openSidebar);
  $('close-sidebar').addEventListener('click', closeSidebar);
  $('scrim').addEventListener('click', closeSidebar);
  window.addEventListener('hashchange', () => {
    const id = location.hash.slice(1);
    if (id && (!state.current || state.current.id !== id) && !state.replying) openSession(id);
  });

  state.addEventListener('change', (ev) => {
    switch (ev.detail) {
      case 'sessions': renderSessions(); break;
      case 'current': renderHeader(); renderMessages(); renderSettings(); renderSessions(); break;
      case 'reply-start': renderMessages(); break;
      case 'reply-delta': queueReplyRender(); break;
      case 'reply-end': renderHeader(); break;
      case 'status': renderNotice(); break;
      default: break;
    }
  });
}

async function loadModelInfo() {
  const m = (await api.models())[0];
  if (m) { state.maxContext = m.max_model_len || m.context_length || null; renderHeader(); }
}

async function main() {
  initTheme();
  initScroll();
  wire();
  const ok = await refreshSessions();
  const id = location.hash.slice(1);
  if (ok && id) await openSession(id);
  else renderHeader();
  loadModelInfo();
  pollStatus();
  document.body.dataset.ready = '1';
}

main();
