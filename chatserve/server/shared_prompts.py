"""Operator-marked shared system prompts: how many leading prompt tokens may be cached across owners.

`--shared-system-prompt TEXT` names a system prompt whose KV blocks every owner may share; the rest of
each prompt stays salted per owner. Not the hashing itself (core/kv_cache_manager.py add_seq).
"""
from __future__ import annotations

import logging
from typing import Any, Hashable, Sequence

log = logging.getLogger("chatserve.server")


def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SharedPrompts:
    """Token ids of each shared system prompt rendered alone by the chat template (computed once)."""

    def __init__(self, texts: tuple[str, ...] | list[str], tokenizer: Any) -> None:
        self.texts = frozenset(t for t in texts if t)
        self.tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}

    def _prefix_ids(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            try:
                ids = list(self.tokenizer.apply_chat_template(
                    [{"role": "system", "content": text}], add_generation_prompt=False))
            except Exception:           # a template that refuses a lone system message: share nothing
                log.warning("shared system prompt could not be rendered alone; not sharing it")
                ids = []
            self._ids[text] = ids
        return ids

    def shared_tokens(self, messages: list[dict], prompt_ids: list[int]) -> int:
        """Leading tokens of prompt_ids that belong to a shared system prompt (0 = none).

        Only when the first message is a system message whose text is marked shared; the count is
        the common prefix of the prompt and that system message rendered alone, so the shared
        tokens are exactly the public prompt's tokens and never anything an owner wrote."""
        if not self.texts or not messages:
            return 0
        first = messages[0]
        if first.get("role") not in ("system", "developer") or first.get("content") not in self.texts:
            return 0
        return common_prefix_len(self._prefix_ids(first["content"]), prompt_ids)
