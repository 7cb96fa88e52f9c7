"""Re-prefilling a session's history after a reply with reasoning, so the next turn hits the cache.

A template that drops earlier turns' thinking (Qwen3, DeepSeek-R1, QwQ) re-renders the last reply
without its `<think>` block in the next prompt, so the K/V the model computed for that reply (which
attended to the thinking) matches nothing there: only the previous prompt is reused. While the user
reads, this prefills the history as the next prompt will start (the template's own rendering, cut after
the reply's end-of-turn token) with keep_warm and one sampled token that is dropped. Turn N+1 then
finds all of it cached, as a chat without reasoning does. The thinking tokens themselves never come
back: that share of the previous turn is the template's bound (docs/chat-templates.md).

Not the turn itself (turns.py) and not the template rendering (chatserve/text/).
"""
from __future__ import annotations

import logging
from typing import Any

from chatserve.core.request import SamplingParams
from chatserve.server.identity import cache_salt

log = logging.getLogger("chatserve.sessions")

# a user message whose text cannot occur in a chat: where the next prompt's new part would start
_NEXT = "\u2063chatserve-next-user-message\u2063"


def next_prompt_prefix(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int] | None:
    """The ids the next prompt of this chat starts with: `messages` (ending with the reply) rendered as
    the template renders them once another user message follows, up to and including the reply's
    end-of-turn token (a special token: a hard tokenization boundary, so these ids are exactly the
    next prompt's first ids). None when the template writes no end-of-turn token after the reply."""
    eot = tokenizer.end_of_turn_id
    if eot is None:
        return None
    text = tokenizer.render_chat([*messages, {"role": "user", "content": _NEXT}], add_generation_prompt=False)
    head = text[:text.find(_NEXT)] if _NEXT in text else ""
    marker = tokenizer.decode([eot], skip_special_tokens=False)
    cut = head.rfind(marker)
    if cut < 0:
        return None
    ids: list[int] = tokenizer.encode(head[:cut + len(marker)], add_special_tokens=False)
    return ids


async def rewarm(state: Any, messages: list[dict[str, Any]], *, owner: str, request_id: str,
                 model: str | None = None) -> int:
    """Prefill the next prompt's prefix for `owner` on `model` (None: the default) while it is loaded
    (keep_warm; the sampled token is dropped). Returns the prefix length in tokens (0: nothing to do).
    Never raises: a failure only costs the next turn its cache hit."""
    try:
        served = state.models.peek(model)
        if served is None:                 # unloaded meanwhile: its prefix cache is gone anyway
            return 0
        ids = next_prompt_prefix(served.tokenizer, messages)
        if not ids or len(ids) >= served.max_model_len:
            return 0
        stream = served.engine.submit(ids, SamplingParams(max_tokens=1, ignore_eos=True), request_id=request_id,
                                     cache_salt=cache_salt(state, owner), keep_warm=True)
        async for _ in stream:
            pass
        return len(ids)
    except Exception as e:                 # overload, shutdown, a template that refuses the sentinel
        log.debug("session rewarm %s skipped: %s", request_id, e)
        return 0
