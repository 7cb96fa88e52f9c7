"""The scheduler ↔ runner contract: plain dataclasses, nothing else crosses that boundary.

`SchedulerOutput` says what to compute this step; `RunnerOutput` returns what was sampled; the
scheduler's `update()` turns both into `RequestEvent`s for the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from chatserve.core.request import FinishReason, SamplingParams


@dataclass(frozen=True)
class CopyOp:
    """Copy the whole KV content of physical block `src` into block `dst` (copy-on-write)."""

    src: int
    dst: int


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute `token_ids` at positions start_pos.. and maybe sample.

    Slots: token at position p lives in block block_table[p // block_size], offset p % block_size.
    """

    request_id: str
    token_ids: list[int]        # the new tokens to run this step (a prefill chunk, or 1 for decode)
    start_pos: int              # position of token_ids[0] == tokens already in the cache
    block_table: list[int]      # physical blocks covering positions [0, start_pos + len(token_ids))
    sample: bool                # True when the chunk reaches the end of the known tokens: sample one
    params: SamplingParams
    # The request's whole prompt (not copied): required, because it is how the runner tells prompt rows
    # (position < len) from generated ones (RowSplit: a generated row takes the decode kernels), and what
    # repetition penalties and prompt logprobs read.
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)  # for penalties and seeded generators
    seed: int | None = None     # the per-sequence seed (params.seed + sample_index), None = unseeded
    # Speculative decoding: token_ids = [last token] + draft_token_ids. The runner returns logits-checked
    # tokens for every position (RunnerOutput.accepted); empty = an ordinary step.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached prefix + new tokens)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    step_id: int
    seqs: list[ScheduledSeq]
    copy_ops: list[CopyOp] = field(default_factory=list)   # run before the forward, in one batched call
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step: runner drops state
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.copy_ops


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None     # 1-based vocabulary rank of token_id (set for prompt logprobs)


@dataclass
class RunnerOutput:
    step_id: int
    sampled: dict[str, int] = field(default_factory=dict)             # request_id → token (sample=True seqs)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)   # only where params.logprobs is set
    errors: dict[str, str] = field(default_factory=dict)              # request_id → message: ends it with ERROR
    # params.prompt_logprobs seqs only: the logprob of prompt token p + 1 under the logits at each
    # position p of this chunk that has a next prompt token (entry i ↔ prompt position start_pos + 1 + i)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # seqs with draft_token_ids: the drafts the model agrees with, then its own next token (1..k+1
    # tokens; sampled[request_id] holds that last one too)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # the runner's own wall time for the step (None: not timed, e.g. a scripted runner); the scheduler
    # learns what prompt tokens cost from it (step_cost.py)
    elapsed_s: float | None = None


@dataclass
class RequestEvent:
    """What happened to one sequence in one step, for the engine to detokenize and stream."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # once, when the prompt is computed: prompt positions 1..len-1 (params.prompt_logprobs requests)
    prompt_logprobs: list[TokenLogprob] | None = None
