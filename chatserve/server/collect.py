"""Non-streaming responses: the chunks chat_service streams, folded into one chat.completion or
text_completion body (best_of picks its samples here).

An engine error met while folding is raised as an APIError. Not the chunks themselves (chat_service.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from chatserve.server.errors import APIError, status_for
from chatserve.server.protocol import ChatRequest, CompletionRequest
from chatserve.toolcalls.stream import ToolCallFolder


def _raise_chunk_error(c: dict) -> None:
    e = c["error"]
    raise APIError(status_for(e.get("code")), e["message"], code=e.get("code"), type="server_error")


@dataclass
class _Folded:
    """Per choice: text, finish and stop reasons, logprobs, prompt logprobs; plus the first chunk and usage."""

    n: int
    head: dict[str, Any] = field(default_factory=dict)
    usage: dict | None = None
    texts: list[str] = field(init=False)
    reasons: list[str | None] = field(init=False)
    stops: list[Any] = field(init=False)
    lps: list[dict | None] = field(init=False)
    plps: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.texts = [""] * self.n
        self.reasons = [None] * self.n
        self.stops = [None] * self.n
        self.lps = [None] * self.n
        self.plps = [None] * self.n


async def _fold(chunks: AsyncIterator[dict], n: int, piece: Callable[[dict], str]) -> _Folded:
    """Fold streamed chunks into per-choice text, finish/stop reason and logprobs, plus head and usage."""
    f = _Folded(n)
    async for c in chunks:
        if "error" in c:
            _raise_chunk_error(c)
        f.head = f.head or c
        if c.get("usage"):
            f.usage = c["usage"]
        for ch in c["choices"]:
            i = ch["index"]
            f.texts[i] += piece(ch)
            if ch.get("finish_reason"):
                f.reasons[i] = ch["finish_reason"]
                f.stops[i] = ch.get("stop_reason")
            if ch.get("prompt_logprobs") is not None:
                f.plps[i] = ch["prompt_logprobs"]
            if ch.get("logprobs"):
                lp = f.lps[i] = f.lps[i] or {}
                for k, v in ch["logprobs"].items():     # chat: content; completions: tokens, token_logprobs, ...
                    lp.setdefault(k, []).extend(v or [])
    return f


async def collect_chat(chunks: AsyncIterator[dict], req: ChatRequest) -> dict:
    n = req.params.n
    calls = ToolCallFolder(n)
    thoughts = [""] * n

    def piece(ch: dict) -> str:
        thoughts[ch["index"]] += (ch.get("delta") or {}).get("reasoning_content") or ""
        return calls.content(ch)

    f = await _fold(chunks, n, piece)
    out = {"id": f.head["id"], "object": "chat.completion", "created": f.head["created"],
           "model": f.head["model"], "system_fingerprint": None,
           "choices": [{"index": i, "message": _message(calls.message(i, f.texts[i]), thoughts[i], req),
                        "logprobs": f.lps[i], "finish_reason": f.reasons[i], "stop_reason": f.stops[i]}
                       for i in range(n)],
           "usage": f.usage}
    if req.service_tier is not None:
        out["service_tier"] = req.service_tier
    if req.prompt_logprobs is not None:     # vLLM: one top-level list (the n samples share the prompt)
        out["prompt_logprobs"] = next((x for x in f.plps if x is not None), None)
    return out


def _message(msg: dict, reasoning: str, req: ChatRequest) -> dict:
    """The assistant message, with reasoning_content (and `reasoning`) beside content when the model
    reasons (null when it did not think this time); a reply that is all reasoning has content null."""
    if req.reasoning is None:
        return msg
    text = reasoning or None
    if text is not None and msg.get("content") == "" and not msg.get("tool_calls"):
        msg = {**msg, "content": None}
    return {**msg, "reasoning_content": text, "reasoning": text}


def _best_of(f: _Folded, per_prompt: int, keep: int) -> list[int]:
    """Per prompt, the `keep` samples with the highest cumulative logprob, in that order."""
    order: list[int] = []
    for p in range(f.n // per_prompt):
        ids = range(p * per_prompt, (p + 1) * per_prompt)
        score = {i: sum(v for v in ((f.lps[i] or {}).get("token_logprobs") or []) if v is not None)
                 for i in ids}
        order += sorted(ids, key=lambda i: -score[i])[:keep]
    return order


async def collect_completion(chunks: AsyncIterator[dict], req: CompletionRequest) -> dict:
    per_prompt = req.params.n
    total = per_prompt * max(1, len(req.prompts))
    f = await _fold(chunks, total, lambda ch: ch["text"])
    order = list(range(total))
    lps = f.lps
    if req.best_of:
        order = _best_of(f, per_prompt, req.n)
        if req.logprobs is None:
            lps = [None] * total
    return {"id": f.head.get("id"), "object": "text_completion", "created": f.head.get("created"),
            "model": f.head.get("model"), "system_fingerprint": None,
            "choices": [{"index": k, "text": f.texts[i], "logprobs": lps[i], "finish_reason": f.reasons[i],
                         "stop_reason": f.stops[i],
                         **({"prompt_logprobs": f.plps[i]} if req.prompt_logprobs is not None else {})}
                        for k, i in enumerate(order)],
            "usage": f.usage}
