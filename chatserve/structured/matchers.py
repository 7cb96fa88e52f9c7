"""Per-request grammar matchers and the one batched token bitmask a sampling step applies to its rows.

Lives beside the sampler (runtime side, torch): a request's matcher is created from its compiled spec
on first use, caught up with the tokens it already has (a resumed preempted request, a restart), fed
each sampled token, and dropped when the request ends. Not compilation (compiler.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import llguidance
import numpy as np
import torch

from chatserve.core.outputs import ScheduledSeq

log = logging.getLogger(__name__)


def constrained_rows(seqs: Sequence[ScheduledSeq]) -> list[int]:
    """Rows whose request carries an output constraint (usually none: then nothing else runs)."""
    return [i for i, s in enumerate(seqs) if getattr(s.params, "structured", None) is not None]


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    consumed: int = 0          # output tokens fed to the matcher


class GrammarMasks:
    """Matchers by request id; fills one int32 bitmask [R, ceil(V/32)] for the R constrained rows.

    The fill runs on the step thread just before the mask is applied. On CUDA that overlaps the
    forward, whose kernels are still queued (nothing synchronizes before the sampler). On CPU a
    helper thread computing it during the forward took a core from the forward's OpenMP team and
    made steps several times slower on 2 cores (docs/benchmarks.md), so there is none.
    """

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    def drop(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def apply(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place, for `rows` of the batch."""
        # logits: [B, V] float32; rows: indices of constrained rows
        bitmask = self._fill([seqs[i] for i in rows], logits.shape[1])   # [R, W] int32
        V = logits.shape[1]
        # one bit per token, token 32*w + b at bit b of word w (little-endian words → bytes → bits);
        # the words are inverted first, so the unpacked bits are the forbidden tokens
        forbid = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :V]
        forbid_t = torch.from_numpy(forbid.view(np.bool_)).to(logits.device, non_blocking=True)  # [R, V]
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(forbid_t, float("-inf"))
        else:
            for r, i in enumerate(rows):
                logits[i].masked_fill_(forbid_t[r], float("-inf"))

    def _fill(self, seqs: Sequence[ScheduledSeq], vocab_size: int) -> torch.Tensor:
        matchers = [self._state(s, vocab_size).matcher for s in seqs]
        bitmask = torch.zeros(len(seqs), (vocab_size + 31) // 32, dtype=torch.int32)  # [R, W]
        words = bitmask.shape[1]
        # one matcher after the other: llguidance's parallel executor hands rows to a thread pool,
        # which on a busy small machine costs far more than the masks (0.25 vs 35 ms for 16 rows on
        # 2 loaded cores, docs/benchmarks.md)
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
        return bitmask

    # ── state ───────────────────────────────────────────────────────────────────────────────────
    def _state(self, s: ScheduledSeq, vocab_size: int) -> _State:
        st = self._states.get(s.request_id)
        if st is None:
            compiled = s.params.structured.compiled
            if compiled is None:
                raise RuntimeError("structured output without a compiled grammar")
            if compiled.vocab_size != vocab_size:
                raise RuntimeError(f"grammar compiled for {compiled.vocab_size} tokens, logits have {vocab_size}")
            st = self._states[s.request_id] = _State(compiled.template.deep_copy())
        out = s.output_token_ids
        if st.consumed > len(out):    # tokens the scheduler dropped: forget them
            st.matcher.rollback(st.consumed - len(out))
            st.consumed = len(out)
        if st.consumed < len(out):    # state rebuilt (new matcher, resumed request): replay the output
            st.matcher.consume_tokens(list(out[st.consumed:]))
            st.consumed = len(out)
        return st

    def accept(self, seqs: Sequence[ScheduledSeq], rows: list[int], tokens: Sequence[int]) -> None:
        """Feed each constrained row its sampled token."""
        for i in rows:
            st = self._states.get(seqs[i].request_id)
            if st is None:
                continue
            if not st.matcher.consume_token(int(tokens[i])):
                log.warning("request %s: grammar rejected token %d: %s", seqs[i].request_id, tokens[i],
                            st.matcher.get_error())
            st.consumed += 1
