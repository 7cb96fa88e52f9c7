"""Streaming think-block parsers: text deltas → (reasoning_delta, content_delta).

A reasoning model writes `<think> reasoning </think> answer`. The block may be opened by the chat
template (the prompt ends with `<think>`; the output holds only `</think>`), closed by it (thinking
switched off: the prompt ends with `<think>\n\n</think>`), opened by the output, cut off by max_tokens
(everything after `<think>` is reasoning), or skipped by the model (no tag at all). Tags split across
deltas are held back until they can be told apart from text. Whitespace around the tags is dropped.
Not the HTTP shapes (the server maps the pairs to `reasoning_content` / `content`).
"""
from __future__ import annotations

from typing import Literal, Protocol

from chatserve.reasoning.harmony import HarmonyParser

Pair = tuple[str, str]           # (reasoning_delta, content_delta)
_State = Literal["undecided", "reasoning", "content"]


class ThinkTagParser:
    """One request's parser. `implicit_open`: output that does not start with the start tag is
    reasoning until the end tag (DeepSeek-R1, whose template or habit opens the block unseen)."""

    name = "think"
    start = "<think>"
    end = "</think>"
    implicit_open = False

    def __init__(self, prompt_text: str = "") -> None:
        opened = prompt_opens_block(prompt_text, self.start, self.end)
        self._state: _State
        if opened is True:
            self._state = "reasoning"
        elif opened is False:
            self._state = "content"
        else:
            self._state = "reasoning" if self.implicit_open else "undecided"
        self._buf = ""                  # text held back: a possible tag prefix or trailing whitespace
        self._lead = True               # at the start of a part (reasoning or content): drop leading ws
        self.thinking_started = self._state == "reasoning"
        self.reasoning_done = self._state == "content"

    @property
    def phase(self) -> _State:
        """'undecided' (the output may open a block), 'reasoning' or 'content'."""
        return self._state

    @property
    def in_reasoning(self) -> bool:
        """True while output is (or may still be) reasoning: the answer has not started."""
        return not self.reasoning_done

    def feed(self, text: str) -> Pair:
        """The reasoning and content parts of a new text delta (either may be "")."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if not self._step(reasoning, content, final=False):
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> Pair:
        """Whatever was held back, at the end of the output (a block cut off stays reasoning)."""
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if not self._step(reasoning, content, final=True):
                break
        if self._state == "undecided" or self._state == "reasoning":
            if self._buf:
                (reasoning if self._state == "reasoning" else content).append(self._buf.rstrip())
        self._buf = ""
        return "".join(reasoning), "".join(content)

    # ---- one step of the state machine: True when it made progress ---------------------------------
    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        if self._state == "undecided":
            return self._decide(final)
        if self._state == "reasoning":
            return self._reasoning_step(reasoning, final)
        piece = self._buf.lstrip() if self._lead else self._buf
        if self._lead and not piece and not final:
            return False                    # whitespace only so far: wait for the answer's first char
        self._lead = self._lead and not piece
        self._buf = ""
        if piece:
            content.append(piece)
        return False

    def _decide(self, final: bool) -> bool:
        """At the output's start: a start tag opens reasoning, anything else is the answer."""
        s = self._buf.lstrip()
        if s.startswith(self.start):
            self._buf = s[len(self.start):]
            self._state, self.thinking_started, self._lead = "reasoning", True, True
            return True
        if (self.start.startswith(s)) and not final:
            return False                    # "", "<", "<th"…: could still be the tag
        self._state, self.reasoning_done = "content", True
        return True

    def _reasoning_step(self, reasoning: list[str], final: bool) -> bool:
        buf = self._buf
        if self._lead:
            stripped = buf.lstrip()
            if stripped.startswith(self.start):          # a repeated start tag after a template-opened one
                buf = stripped[len(self.start):]
            elif self.start.startswith(stripped) and stripped and not final:
                self._buf = buf
                return False
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
        k = buf.find(self.end)
        if k >= 0:
            if buf[:k].rstrip():
                reasoning.append(buf[:k].rstrip())
            self._buf = buf[k + len(self.end):]
            self._state, self.reasoning_done, self._lead = "content", True, True
            return True
        keep = _held_suffix(buf, self.end)
        emit, hold = buf[:len(buf) - keep], buf[len(buf) - keep:]
        body = emit.rstrip()
        hold = emit[len(body):] + hold                   # trailing whitespace waits: it may precede the tag
        if body:
            reasoning.append(body)
            self._lead = False
        self._buf = hold
        return False


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_opens_block(prompt_text: str, start: str, end: str) -> bool | None:
    """True when the prompt ends inside an open think block (the template opened it), False when it ends
    right after a closed one (thinking switched off), None when it says nothing."""
    tail = prompt_text.rstrip()
    if tail.endswith(start):
        return True
    if tail.endswith(end) and start in tail[-(len(start) + len(end) + 64):]:
        return False
    return None


class Qwen3Parser(ThinkTagParser):
    """Qwen3 / QwQ: the model writes `<think>` itself (Qwen3) or the template opens it (QwQ, Qwen3
    thinking-2507); no tag at all means the model skipped thinking: all answer."""
    name = "qwen3"


class DeepSeekR1Parser(ThinkTagParser):
    """DeepSeek-R1 and its distills: reasoning comes first even without a visible `<think>`; output
    with no `</think>` is all reasoning (cut off)."""
    name = "deepseek_r1"
    implicit_open = True


class ReasoningParser(Protocol):
    """What the server reads: a think-tag parser or gpt-oss's harmony channels (harmony.py)."""
    name: str
    start: str                     # the reasoning's opening and closing marks (single tokens or not)
    end: str
    thinking_started: bool
    reasoning_done: bool

    @property
    def phase(self) -> str: ...
    @property
    def in_reasoning(self) -> bool: ...
    def feed(self, text: str) -> Pair: ...
    def finish(self) -> Pair: ...


PARSERS: dict[str, type[ThinkTagParser] | type[HarmonyParser]] = {
    "qwen3": Qwen3Parser, "deepseek_r1": DeepSeekR1Parser, "harmony": HarmonyParser}


def needs_special_tokens(name: str) -> bool:
    """The parser reads special tokens (harmony's channel markers), so the output keeps them."""
    return bool(getattr(PARSERS.get(name), "needs_special_tokens", False))


def parser_for(name: str, prompt_text: str = "") -> ReasoningParser:
    """A fresh parser for one request; `prompt_text` tells whether the template opened or closed the block."""
    try:
        cls = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(PARSERS)}") from None
    return cls(prompt_text)
