"""IncrementalDetokenizer: sampled ids → UTF-8-safe text deltas, with stop strings matched across tokens.

Not the tokenizer (tokenizer.py) and not sampling; one instance per generated sequence.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatserve.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Sampled ids → text deltas safe to stream, with stop strings matched across token boundaries.

    Byte-level tokenizers: each token's bytes go through an incremental UTF-8 decoder, which holds an
    incomplete character until its last byte arrives (exact, O(1) per token).
    Other tokenizers (sentencepiece: leading-space rules, byte-fallback tokens): a small window of ids
    is re-decoded each push: `prefix` ids give context (e.g. a leading space), text past `read` is
    new; a tail that decodes to U+FFFD (a character cut between tokens) is held until it completes.
    Text that might be the start of a stop string is held until it cannot be. (tokenizers'
    `DecodeStream` does the window's job per token but cannot flush a character still incomplete at
    the end of a sequence, so the window stays.)
    """

    _MAX_WINDOW = 32  # window path: a character is at most 4 byte tokens; past this, U+FFFD is real

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True, prompt_tail: list[int] | None = None) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop_str
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._stop_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if tokenizer.is_byte_level else None
        self._ids: list[int] = list(prompt_tail or [])[-4:]  # window path: a few context ids suffice
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._sent = 0           # window path: chars past prefix_text already emitted
        self._held = ""          # decoded but held back: could be the start of a stop string
        self._parts: list[str] = []
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        if self._utf8 is not None:
            skip = self._tok.special_token_ids if self._skip else ()
            data = b"".join(self._tok.token_bytes(t) for t in token_ids if t not in skip)
            return self._emit(self._utf8.decode(data), final=False)
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids)
        new = window_text[len(self._prefix_text) + self._sent:]
        if window_text.endswith("\ufffd") and len(self._ids) - self._read < self._MAX_WINDOW:
            safe = new.rstrip("\ufffd")  # everything before the incomplete character is final
            self._sent += len(safe)
            return self._emit(safe, final=False)
        self._advance()
        return self._emit(new, final=False)

    def flush(self) -> str:
        """At finish: whatever is still held (an incomplete character, a partial stop string)."""
        if self.stopped:
            return ""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
        else:
            delta = self._decode(self._ids)[len(self._prefix_text) + self._sent:]
            self._advance()
        return self._emit(delta, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _advance(self) -> None:
        """Window path: emitted text now ends at the last id; the old read offset becomes the prefix."""
        del self._ids[: self._read]  # keep memory and decode work bounded
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._sent = 0

    def _emit(self, delta: str, final: bool) -> str:
        if not self._stops:
            out = delta
        else:
            buf = self._held + delta
            hit = _earliest_stop(buf, self._stops)
            if hit is not None:
                at, s = hit
                out = buf[: at + len(s)] if self._include_stop else buf[:at]
                self._held, self.stopped, self.stop_str = "", True, s
            elif final:
                out, self._held = buf, ""
            else:
                keep = 0
                for k in range(min(len(buf), self._max_stop - 1), 0, -1):
                    if buf[-k:] in self._stop_prefixes:
                        keep = k
                        break
                out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self._parts.append(out)
        return out


def _earliest_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


