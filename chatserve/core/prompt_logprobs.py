"""PromptLogprobs: the prompt logprobs of the requests that ask for them (params.prompt_logprobs),
gathered chunk by chunk and handed over whole once the prompt is computed.

Bookkeeping only: the runner computes each chunk's logprobs (RunnerOutput.prompt_logprobs).
"""
from __future__ import annotations

from chatserve.core.outputs import RunnerOutput, ScheduledSeq, TokenLogprob


class PromptLogprobs:
    """request id → the prompt logprobs gathered so far (entry i is prompt position i + 1).

    A request in here computes every prompt position (no prefix-cache hit), so its logits exist."""

    def __init__(self) -> None:
        self._gathered: dict[str, list[TokenLogprob]] = {}

    def __len__(self) -> int:
        return len(self._gathered)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._gathered

    def track(self, request_id: str) -> None:
        self._gathered[request_id] = []

    def drop(self, request_id: str) -> None:
        """Forget a request (it finished, or a forked sibling whose leader reports the prompt)."""
        self._gathered.pop(request_id, None)

    def gather(self, seq: ScheduledSeq, res: RunnerOutput, computed: int) -> list[TokenLogprob] | None:
        """Add one computed chunk; the whole list (positions 1..len-1) once the prompt is computed,
        else None. A chunk recomputed after preemption replaces what it covers."""
        rid = seq.request_id
        acc = self._gathered.get(rid)
        if acc is None:
            return None
        chunk = res.prompt_logprobs.get(rid)
        if chunk:
            del acc[seq.start_pos:]
            acc.extend(chunk)
        if computed < len(seq.prompt_token_ids) - 1:
            return None
        return self._gathered.pop(rid)
