"""Logprobs in the shapes clients parse: chat `content` entries, the legacy completions lists (with an
echoed prompt), and vLLM's `prompt_logprobs`; -inf is written as a finite floor.

Only formatting of the engine's `TokenLogprob`s; the chunks that carry them are built in chat_service.py.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatserve.core.outputs import TokenLogprob
    from chatserve.core.protocols import TokenizerLike
    from chatserve.engine.deltas import Delta
    from chatserve.server.state import ServerState

LOGPROB_FLOOR = -9999.0    # what -inf (or a NaN) logprob is written as: JSON has no infinities


def finite(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_FLOOR


def token_text(tok: Any, tid: int) -> str:
    """A token's display text (its own piece where the tokenizer has one, else its decode)."""
    try:
        return tok.token_str(tid)
    except Exception:
        return tok.decode([tid])


def token_bytes(tok: TokenizerLike, tid: int) -> list[int]:
    """The token's own bytes (part of a UTF-8 character stays that part), not its display text's."""
    return list(tok.token_bytes(tid))


def chat_logprobs(state: ServerState, d: Delta) -> dict | None:
    """A chat choice's logprobs of one delta: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if not d.logprobs:
        return None
    tok = state.tokenizer

    def entry(tid: int, v: float) -> dict:
        t = token_text(tok, tid)
        return {"token": t, "logprob": finite(v), "bytes": token_bytes(tok, tid)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in d.logprobs]}


def completion_logprobs(state: ServerState, d: Delta, offset: int) -> dict | None:
    """The legacy completions logprobs of one delta, text offsets counted from `offset`."""
    if not d.logprobs:
        return None
    tok = state.tokenizer
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in d.logprobs:
        t = token_text(tok, lp.token_id)
        out["tokens"].append(t)
        out["token_logprobs"].append(finite(lp.logprob))
        out["top_logprobs"].append({token_text(tok, i): finite(v) for i, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(t)
    return out


def vllm_prompt_logprobs(state: ServerState, lps: list[TokenLogprob], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then per position {token id:
    {logprob, rank, decoded_token}} for the prompt token and the k most likely."""
    tok = state.tokenizer
    out: list[dict | None] = [None]
    for lp in lps:
        entry = {str(lp.token_id): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                    "decoded_token": token_text(tok, lp.token_id)}}
        for rank, (i, v) in enumerate(lp.top[:k], 1):
            entry.setdefault(str(i), {"logprob": finite(v), "rank": rank, "decoded_token": token_text(tok, i)})
        out.append(entry)
    return out


def echo_logprobs(state: ServerState, ids: list[int], lps: list[TokenLogprob], k: int) -> dict:
    """The legacy completions logprobs of an echoed prompt: every prompt token, its logprob (null for
    the first) and the k most likely tokens at its position with the prompt token itself (up to k + 1)."""
    tok = state.tokenizer
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for pos, tid in enumerate(ids):
        t = token_text(tok, tid)
        lp = lps[pos - 1] if 0 < pos <= len(lps) else None
        out["tokens"].append(t)
        out["text_offset"].append(offset)
        offset += len(t)
        out["token_logprobs"].append(None if lp is None else finite(lp.logprob))
        if lp is None:
            out["top_logprobs"].append(None)
            continue
        top = {token_text(tok, i): finite(v) for i, v in lp.top[:k]}
        top.setdefault(t, finite(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two legacy completions logprobs dicts one after the other (an echoed prompt, then its first tokens)."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}
