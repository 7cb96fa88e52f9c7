"""One choice's output split into reasoning and answer, with the reasoning tokens counted.

Wraps a text-level parser (chatserve/reasoning) for the chunk streams of chat completions and
responses: text deltas in, (reasoning, content) pieces out. Not the parsing rules themselves.
"""
from __future__ import annotations

from chatserve.reasoning import ReasoningParser


class ChoiceReasoning:
    """A delta's tokens count as reasoning while the think block is open (the closing one too); tokens
    before it opens (a harmony header: `<|channel|>analysis`) count once it does."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.tokens = 0
        self._undecided = 0             # tokens read before the parser knew whether thinking started

    def push(self, text: str, n_tokens: int, final: bool) -> tuple[str, str]:
        was_open = self.parser.in_reasoning
        r, c = self.parser.feed(text) if text else ("", "")
        if final:
            r2, c2 = self.parser.finish()
            r, c = r + r2, c + c2
        if was_open:
            self._undecided += n_tokens
            if self.parser.thinking_started:
                self.tokens += self._undecided
                self._undecided = 0
        return r, c


def reasoning_delta(text: str) -> dict[str, str]:
    """A reasoning piece as chat delta / message fields (reasoning_content, and newer vLLM's `reasoning`)."""
    return {"reasoning_content": text, "reasoning": text} if text else {}
