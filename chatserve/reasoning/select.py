"""Which reasoning parser a model gets, and how a request switches its thinking on or off.

The chat template decides: one that writes or strips `<think>` blocks is a reasoning model's. The
family and the template's tokens tell Qwen3-style from DeepSeek-R1-style. Not parsing (parser.py).
"""
from __future__ import annotations

from typing import Any

_DEEPSEEK_MARKS = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_HARMONY_MARKS = ("<|channel|>", "<|message|>")


def is_harmony(chat_template: str | None, family: str | None = None) -> bool:
    """gpt-oss's harmony format: its template writes channels, or the family says gpt-oss."""
    fam = (family or "").lower().replace("-", "_")
    return all(m in (chat_template or "") for m in _HARMONY_MARKS) or "gpt_oss" in fam


def choose_parser_name(chat_template: str | None, family: str | None = None) -> str | None:
    """'harmony' (gpt-oss), 'qwen3', 'deepseek_r1', or None (the template knows no think blocks: nothing
    to parse)."""
    t = chat_template or ""
    if is_harmony(t, family):
        return "harmony"
    if "</think>" not in t:
        return None
    fam = (family or "").lower()
    if "deepseek" in fam or any(m in t for m in _DEEPSEEK_MARKS):
        return "deepseek_r1"
    return "qwen3"


def template_has_thinking_switch(chat_template: str | None) -> bool:
    return "enable_thinking" in (chat_template or "")


# reasoning_effort → the template's switch: "none" turns thinking off; low/medium/high leave it on
# (a chat template has no budget knob; the level is accepted and the model thinks as it does).
def thinking_switch(reasoning_effort: str | None, chat_template: str | None) -> dict[str, Any]:
    """The chat_template_kwargs a reasoning_effort adds: {"enable_thinking": bool} where the template
    has that switch, {"reasoning_effort": level} where it takes the level itself (gpt-oss: "none" is its
    lowest, "low"), {} otherwise (or when no effort was given)."""
    if reasoning_effort is not None and "reasoning_effort" in (chat_template or ""):
        return {"reasoning_effort": "low" if reasoning_effort == "none" else reasoning_effort}
    if reasoning_effort is None or not template_has_thinking_switch(chat_template):
        return {}
    return {"enable_thinking": reasoning_effort != "none"}


def resolve_parser_name(configured: str | None, chat_template: str | None,
                        family: str | None = None) -> str | None:
    """--reasoning-parser when named ('off' turns parsing off), else ('auto', None) the template's choice."""
    if configured == "off":
        return None
    if configured in (None, "auto"):
        return choose_parser_name(chat_template, family)
    return configured
