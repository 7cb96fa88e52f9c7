"""Requests as the scheduler sees them: token ids, sampling parameters, status and progress.

A `Request` is one sequence. A client request with n > 1 becomes n sibling `Request`s that share a
`group_id` (the scheduler forks them from one prefilled prompt). Pure Python; no torch.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # queued, no KV blocks held
    WAITING_FOR_FORK = "waiting_for_fork"  # an n>1 sibling waiting for the group's shared prompt prefill
    RUNNING = "running"          # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"      # blocks freed under memory pressure; requeued at the front, recomputed later
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the context length
    ABORT = "abort"      # cancelled by the client or the server
    ERROR = "error"      # the step failed for this request


@dataclass
class SamplingParams:
    """Per-sequence sampling parameters. Validation of user input happens in the HTTP layer."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None = off; k >= 0 = the sampled token's logprob plus top-k alternatives
    # None = off; k >= 0 = each prompt token's logprob (positions 1..) plus top-k: the runner computes
    # log_softmax at every prompt position, and the scheduler skips the prefix-cache match for it
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)          # stop strings: matched by the detokenizer
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0          # EOS and stop_token_ids are masked until this many tokens are out
    min_tokens_banned_ids: list[int] = field(default_factory=list)   # those ids (set by the HTTP layer)
    skip_special_tokens: bool = True   # drop special tokens from the streamed text
    # Output constraint (chatserve.structured.spec.StructuredSpec: JSON schema, regex, grammar…), opaque
    # here: the HTTP layer compiles it, the sampler's grammar masks apply it. None = unconstrained.
    structured: object | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One sequence: prompt + generated tokens, and how much of it is in the KV cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                 # lower value = served first (FCFS within a priority)
    cache_salt: str | None = None     # prefix-cache isolation key (per owner); None = shared
    shared_prefix_tokens: int = 0     # leading tokens of an operator-shared system prompt (unsalted)
    keep_warm: bool = False           # session-aware caching: keep its blocks in the protected LRU tier
    max_model_len: int | None = None  # context length cap, set by the scheduler
    group_id: str | None = None       # n > 1 siblings share it; None for n == 1
    sample_index: int = 0             # which of the n samples this is

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose K/V are in the cache
    num_cached_tokens: int = -1       # prefix-cache hit at first admission (-1 = not admitted yet)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
