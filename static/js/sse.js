// A Server-Sent Events parser as the HTML spec defines it (its "event stream interpretation"): lines end
// with LF, CRLF or CR, even when a CR and its LF arrive in different network reads. No DOM, no network.

export class SSEParser {
  constructor() {
    this.buf = '';
    this.data = [];
    this.event = '';
    this.lastId = '';
    this.retry = null;
    this.pendingCR = false;   // the last read ended in CR: an LF starting the next read belongs to it
  }

  // Feed decoded text; returns the events completed by it: [{event, data, id}].
  push(text) {
    const out = [];
    let s = text;
    if (this.pendingCR && s.startsWith('\n')) s = s.slice(1);
    this.pendingCR = false;
    this.buf += s;
    let start = 0;
    for (let i = 0; i < this.buf.length; i++) {
      const c = this.buf.charCodeAt(i);
      if (c !== 10 && c !== 13) continue;
      this.line(this.buf.slice(start, i), out);
      if (c === 13) {
        if (i + 1 < this.buf.length) { if (this.buf.charCodeAt(i + 1) === 10) i++; }
        else this.pendingCR = true;
      }
      start = i + 1;
    }
    this.buf = this.buf.slice(start);
    return out;
  }

  // The stream ended: an event without its blank line is discarded, as the spec says.
  end() { this.buf = ''; this.data = []; this.event = ''; return []; }

  line(line, out) {
    if (line === '') {
      if (this.data.length) out.push({ event: this.event || 'message', data: this.data.join('\n'), id: this.lastId });
      this.data = [];
      this.event = '';
      return;
    }
    if (line.charCodeAt(0) === 58) return;          // ":" starts a comment (keep-alive ping)
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.charCodeAt(0) === 32) value = value.slice(1);
    if (field === 'data') this.data.push(value);
    else if (field === 'event') this.event = value;
    else if (field === 'id') { if (!value.includes('\0')) this.lastId = value; }
    else if (field === 'retry') { if (/^\d+$/.test(value)) this.retry = Number(value); }
  }
}

// Async generator of parsed events from a fetch Response body.
export async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) { parser.end(); return; }
      for (const ev of parser.push(value)) yield ev;
    }
  } finally {
    reader.releaseLock();
  }
}
