"""A chat request's reasoning: which parser reads the output, where its think block starts (the prompt's
tail), and the grammar gate that lets structured output begin only after the end-of-thinking token.

Not the parsing itself (chatserve/reasoning) nor the chunk shapes (reasoning_output.py).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatserve.reasoning import ReasoningParser, parser_for, resolve_parser_name
from chatserve.server.errors import invalid
from chatserve.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from chatserve.server.schemas.openai import ChatMessage
    from chatserve.server.served_model import ServedModel

log = logging.getLogger("chatserve.server")
PROMPT_TAIL_TOKENS = 32          # enough of the prompt's end to see a template-opened or -closed block


@dataclass(frozen=True)
class ReasoningPlan:
    parser_name: str
    prompt_tail: str                 # the prompt's last tokens as text (special tokens kept)
    start_id: int | None             # the think tags as single tokens (None: not one token)
    end_id: int | None

    def parser(self) -> ReasoningParser:
        return parser_for(self.parser_name, self.prompt_tail)

    def gate(self, spec: StructuredSpec | None) -> StructuredSpec | None:
        """`spec` applied from after the end-of-thinking token, when the output starts in (or may open) a
        think block; unchanged when thinking is off or the tags are not single tokens."""
        if spec is None:
            return None
        phase = self.parser().phase
        if phase == "content" or self.end_id is None:
            return spec
        if phase == "undecided" and self.start_id is None:
            return spec
        return dataclasses.replace(spec, think=(self.start_id if phase == "undecided" else None, self.end_id))


def _single_token(served: ServedModel, text: str) -> int | None:
    ids = list(served.tokenizer.encode(text))
    return ids[0] if len(ids) == 1 else None


def _family_hint(served: ServedModel) -> str:
    return " ".join(x for x in (served.config.model.model or "", served.name) if x)


def reasoning_plan(served: ServedModel, chat_template: str | None, prompt_ids: list[int]) -> ReasoningPlan | None:
    """The plan for a chat request, or None when the model's template has no think blocks (or
    --reasoning-parser off)."""
    template = chat_template or served.chat_template
    name = resolve_parser_name(served.config.server.reasoning_parser, template, _family_hint(served))
    if name is None:
        return None
    tail = served.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    cls = parser_for(name)
    return ReasoningPlan(name, tail, _single_token(served, cls.start), _single_token(served, cls.end))


def replayed_reasoning(m: ChatMessage, where: str) -> dict[str, Any]:
    """An assistant message's replayed `reasoning_content` (or `reasoning`), for the chat template."""
    text = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if text is None:
        return {}
    if m.role != "assistant":
        raise invalid(f"{where}.reasoning_content is only allowed on assistant messages",
                      f"{where}.reasoning_content")
    return {"reasoning_content": text}


def with_thinking_field(messages: list[dict], chat_template: str | None) -> list[dict]:
    """Replayed reasoning also as `thinking` for a template that reads that name (gpt-oss's); copies."""
    if "message.thinking" not in (chat_template or ""):
        return messages
    return [{**m, "thinking": m["reasoning_content"]} if m.get("reasoning_content") is not None else m
            for m in messages]
