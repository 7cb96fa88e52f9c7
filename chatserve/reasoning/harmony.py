"""gpt-oss's "harmony" output, streamed: channels → (reasoning_delta, content_delta).

A gpt-oss reply is a run of messages, each `[<|start|>assistant][ to=RECIPIENT]<|channel|>NAME[ TYPE]
[<|constrain|>TYPE]<|message|>BODY` ended by `<|end|>` (more messages follow), `<|return|>` (the turn is
over) or `<|call|>` (a tool call: the turn waits for its result). The prompt ends with `<|start|>assistant`,
so the first header starts without it. The `analysis` channel is reasoning; `final` and recipient-less
`commentary` (preambles) are the answer; a message to `functions.NAME` is a tool call, passed on in the
content as `<|start|>assistant to=functions.NAME<|channel|>commentary<|message|>ARGS<|call|>` for the
`gpt_oss` tool-call parser (chatserve/toolcalls/parsers.py). Reads text decoded with its special tokens.
Output with no harmony header at all is all answer. Not the HTTP shapes.
"""
from __future__ import annotations

from typing import Literal

Pair = tuple[str, str]           # (reasoning_delta, content_delta)
_Route = Literal["reasoning", "content", "call", "drop"]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL, START)        # a `<|start|>` with no end before it ends the message too
_HEADER_OPENERS = (START, CHANNEL, " to=", "to=", CONSTRAIN)
MAX_HEADER = 256                 # characters: a longer "header" is text that never was one


def parse_header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header's text (what stands before `<|message|>`)."""
    recipient = None
    at = header.find("to=")
    if at >= 0:
        rest = header[at + 3:]
        end = min((k for k in (rest.find(" "), rest.find("<|")) if k >= 0), default=len(rest))
        recipient = rest[:end]
    channel = ""
    c = header.find(CHANNEL)
    if c >= 0:
        rest = header[c + len(CHANNEL):].lstrip()
        end = min((k for k in (rest.find(" "), rest.find("<|")) if k >= 0), default=len(rest))
        channel = rest[:end]
    return channel, recipient


def _route(channel: str, recipient: str | None) -> _Route:
    if recipient is not None and recipient.startswith("functions."):
        return "call"
    if recipient is not None and recipient != "all":
        return "reasoning"             # a built-in tool's call (browser, python): the model's own work
    return "reasoning" if channel == "analysis" else "content"


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class HarmonyParser:
    """One request's parser (the ThinkTagParser interface: feed, finish, phase, in_reasoning)."""

    name = "harmony"
    start = CHANNEL + "analysis" + MESSAGE     # not single tokens: no grammar gate (reasoning_plan.py)
    end = END
    needs_special_tokens = True

    def __init__(self, prompt_text: str = "") -> None:
        self._buf = ""
        self._in_header = True          # reading a header (True) or a body (False)
        self._plain = False             # output that never was harmony: all answer
        self._route: _Route = "drop"
        self.thinking_started = False
        self.reasoning_done = False

    @property
    def phase(self) -> str:
        if self.reasoning_done:
            return "content"
        return "reasoning" if self.thinking_started and not self._in_header else "undecided"

    @property
    def in_reasoning(self) -> bool:
        return not self.reasoning_done

    def feed(self, text: str) -> Pair:
        self._buf += text
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while self._buf and self._step(out, final=False):
            pass
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> Pair:
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while self._buf and self._step(out, final=True):
            pass
        if self._buf and not self._in_header:
            self._emit(out, self._buf)
            if self._route == "call":
                out["content"].append(CALL)
        elif self._buf and self._plain:
            out["content"].append(self._buf)
        self._buf = ""
        return "".join(out["reasoning"]), "".join(out["content"])

    # ---- the state machine: True when a step made progress ------------------------------------------
    def _step(self, out: dict[str, list[str]], final: bool) -> bool:
        if self._plain:
            out["content"].append(_strip_markers(self._buf))
            self._buf = ""
            return False
        if self._in_header:
            return self._header_step(out, final)
        return self._body_step(out)

    def _header_step(self, out: dict[str, list[str]], final: bool) -> bool:
        buf = self._buf
        at = buf.find(MESSAGE)
        if at < 0:
            s = buf.lstrip("\n")
            opens = any(s.startswith(o) or o.startswith(s) for o in _HEADER_OPENERS)
            if not opens or len(buf) > MAX_HEADER:
                self._plain = True      # no header: the model answered without channels
                self.reasoning_done = True
                return True
            return False
        channel, recipient = parse_header(buf[:at])
        self._buf = buf[at + len(MESSAGE):]
        self._route, self._in_header = _route(channel, recipient), False
        if self._route == "reasoning":
            self.thinking_started = True
        else:
            self.reasoning_done = True
        if self._route == "call":
            out["content"].append(f"{START}assistant to={recipient}{CHANNEL}commentary{MESSAGE}")
        return True

    def _body_step(self, out: dict[str, list[str]]) -> bool:
        buf = self._buf
        ends = [(buf.find(t), t) for t in TERMINATORS if buf.find(t) >= 0]
        if ends:
            k, tag = min(ends)
            self._emit(out, buf[:k])
            if self._route == "call":
                out["content"].append(CALL)
            self._buf = buf[k + (0 if tag == START else len(tag)):]
            self._in_header = True       # the next header (parse_header skips its `<|start|>assistant`)
            return True
        keep = _held_suffix(buf, TERMINATORS)
        self._emit(out, buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _emit(self, out: dict[str, list[str]], text: str) -> None:
        if text and self._route in ("reasoning", "content"):
            out[self._route].append(text)
        elif text and self._route == "call":
            out["content"].append(text)


def _strip_markers(text: str) -> str:
    for tag in (RETURN, END, CALL):
        text = text.replace(tag, "")
    return text
