"""LiveRequest: the scheduler's private record of one unfinished request, and the one place a sampled
token is appended under the stop rules (EOS / stop token ids, then the length limit).

Kept apart from the public `Request`; pure bookkeeping, no torch.
"""
from __future__ import annotations

from chatserve.core.request import FinishReason, Request


class LiveRequest:
    """A live request's token list (prompt + outputs, appended in place), its ordering key, its
    per-sample seed and its stop conditions folded into one set and one length."""

    __slots__ = ("req", "rid", "tokens", "key", "seed", "stop_ids", "limit")

    def __init__(self, req: Request, key: tuple[int, float, int], max_model_len: int) -> None:
        p = req.params
        self.req = req
        self.rid = req.request_id
        self.tokens = list(req.prompt_token_ids) + list(req.output_token_ids)  # appended in place
        self.key = key                     # (priority, arrival_time, admission number): lower first
        self.seed = None if p.seed is None else p.seed + req.sample_index
        # stop checks folded into one set lookup and one length compare
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos
                                                       else frozenset(req.eos_token_ids))
        self.limit = min(len(req.prompt_token_ids) + p.max_tokens, max_model_len)

    def append(self, tok: int) -> FinishReason | None:
        """Append one generated token; the reason it ends the request (STOP, then LENGTH), else None.
        A plain decode step appends its sample; a speculative step appends its accepted run one token
        at a time and stops at the first reason, so nothing past a stop or the limit is kept."""
        self.req.output_token_ids.append(tok)
        tokens = self.tokens
        tokens.append(tok)
        if tok in self.stop_ids:
            return FinishReason.STOP
        if len(tokens) >= self.limit:
            return FinishReason.LENGTH
        return None
