"""Prompt-lookup (n-gram) drafting for speculative decoding: guess a sequence's next tokens by finding
its last n tokens earlier in its own prompt + output and proposing what followed them there.

Bookkeeping only (no model, no torch): the scheduler asks for drafts, the runner verifies them.
"""
from __future__ import annotations

from array import array

from chatserve.core.request import SamplingParams

_ITEM = array("i").itemsize   # bytes per token id in the search buffer


class NgramProposer:
    """Drafts up to `num_tokens` tokens from the most recent earlier occurrence of the context's last n
    tokens, trying n = max_n down to min_n (a longer match is the better predictor). Stateless: each call
    searches the token list afresh (one C-speed `bytes.rfind` per n), so preemption, aborts and
    re-admission need no bookkeeping."""

    def __init__(self, num_tokens: int, max_n: int, min_n: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram_prompt_lookup_min ({min_n}) <= ngram_prompt_lookup_max ({max_n})")
        self.num_tokens = num_tokens
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow `tokens`; [] when no n-gram recurs."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        L = len(tokens)
        if k <= 0 or L <= self.min_n:
            return []
        buf = array("i", tokens).tobytes()
        # An occurrence must end before the last token, so at least one token follows it.
        search_end = (L - 1) * _ITEM
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = buf[(L - n) * _ITEM:]
            hi = search_end
            while True:
                i = buf.rfind(pattern, 0, hi)
                if i < 0:
                    break
                if i % _ITEM == 0:                 # token-aligned: a real match
                    follow = i // _ITEM + n
                    return tokens[follow:follow + k]
                hi = i + len(pattern) - 1          # a match straddling token ids: look further back
        return []


def can_draft(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence's next tokens may be drafted: greedy rows whose next-token rule does not change
    with position (no penalties, no logit_bias, past min_tokens), with no logprobs and no grammar. The
    runner verifies a draft by the plain argmax, which is exactly the sampler's choice for such a row."""
    p = params
    return (p.temperature == 0.0 and p.structured is None and p.logprobs is None and not p.logit_bias
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and num_output_tokens >= p.min_tokens)
