"""Tool calls as OpenAI chunk deltas: text deltas of one choice → `delta.content` / `delta.tool_calls`.

A call first appears with its index, id, type and name (arguments ""), then argument fragments, as the
OpenAI SDKs accumulate them; a non-streaming reply folds the same deltas (ToolCallFolder). Not parsing
(parsers.py).
"""
from __future__ import annotations

import uuid
from typing import Any

from chatserve.toolcalls.parsers import ToolCallParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's output: feed text deltas, get chat deltas; `finish_reason` maps stop → tool_calls."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._calls_sent: list[tuple[str, int]] = []   # (id, argument characters sent) per call

    def push(self, text: str, final: bool = False) -> dict:
        """The chat delta (`content` and/or `tool_calls`) for new text; {} when nothing is certain yet."""
        self._text += text
        ex = self._parser.extract(self._text, final)
        delta: dict[str, Any] = {}
        if not ex.calls or not self._calls_sent:
            piece = ex.content[self._content_sent:]
            if piece:
                delta["content"] = piece
                self._content_sent += len(piece)
        calls: list[dict[str, Any]] = []
        for i, c in enumerate(ex.calls):
            if c.name is None:
                break                   # arguments wait until the name is known
            if self._parser.whole_calls and not c.arguments_done:
                break                   # forced calls go out whole: one cut off by max_tokens never does
            if i == len(self._calls_sent):
                cid = new_call_id()
                self._calls_sent.append((cid, 0))
                calls.append({"index": i, "id": cid, "type": "function",
                              "function": {"name": c.name, "arguments": ""}})
            cid, sent = self._calls_sent[i]
            frag = c.arguments[sent:]
            if frag:
                self._calls_sent[i] = (cid, sent + len(frag))
                if calls and calls[-1]["index"] == i:
                    calls[-1]["function"]["arguments"] += frag
                else:
                    calls.append({"index": i, "function": {"arguments": frag}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._calls_sent else reason


class ToolCallFolder:
    """Accumulates `delta.tool_calls` of n choices into complete `message.tool_calls` (non-streaming)."""

    def __init__(self, n: int) -> None:
        self._calls: list[list[dict]] = [[] for _ in range(n)]

    def content(self, choice: dict) -> str:
        """Record a chunk choice's tool-call deltas; return its content piece (for the text fold)."""
        delta = choice.get("delta") or {}
        for tc in delta.get("tool_calls") or ():
            calls = self._calls[choice["index"]]
            if tc["index"] == len(calls):
                calls.append({"id": tc.get("id"), "type": "function",
                              "function": {"name": tc["function"].get("name"), "arguments": ""}})
            calls[tc["index"]]["function"]["arguments"] += tc["function"].get("arguments") or ""
        return delta.get("content") or ""

    def message(self, index: int, text: str) -> dict:
        calls = self._calls[index]
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
