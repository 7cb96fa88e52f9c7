"""The engine's seams as `Protocol`s: what AsyncEngine and LLM need from a runner, a scheduler, a KV cache
manager and a tokenizer. Structural types only (the real classes and the test fakes both satisfy them).

Pure Python, no torch: the runtime's ModelRunner satisfies `Runner` without this module importing it.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from chatserve.core.outputs import RequestEvent, RunnerOutput, SchedulerOutput
from chatserve.core.request import FinishReason, Request


class Runner(Protocol):
    """Runs one scheduled step on the model (on the engine's step thread)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_path(self) -> str: ...

    @property
    def model_key(self) -> str: ...   # the weights and dtype in prefix hashes (another model's blocks never match)

    @property
    def kv_window(self) -> int | None: ...   # at most this many past positions are read (sliding window), or None

    @property
    def kv_cache_dtype(self) -> str: ...     # --kv-cache-dtype as configured ("auto" = the model dtype)

    @property
    def vocab_size(self) -> int: ...            # the width of the model's logits (may exceed the tokenizer's)

    @property
    def eos_token_ids(self) -> Sequence[int]: ...   # the model config's end-of-sequence ids (may be empty)

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


class KVStatsLike(Protocol):
    usage: float
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    prefix_queries: int
    prefix_hits: int


class KVCache(Protocol):
    """The block bookkeeping the engine reads for stats and resets for benchmarks."""

    def stats(self) -> KVStatsLike: ...

    def reset_prefix_cache(self) -> bool: ...


class SchedulerLike(Protocol):
    """Queues, admission and the step plan (core/scheduler.py, or a scripted fake in tests)."""

    @property
    def num_preemptions(self) -> int: ...

    @property
    def spec_num_drafts(self) -> int: ...            # speculative decoding totals (0 when it is off)

    @property
    def spec_num_draft_tokens(self) -> int: ...

    @property
    def spec_num_accepted_tokens(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def has_unfinished(self) -> bool: ...

    def add_request(self, req: Request) -> None: ...

    def add_group(self, reqs: list[Request]) -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(self, out: SchedulerOutput, res: RunnerOutput) -> list[RequestEvent]: ...

    def finish_request(self, request_id: str, reason: FinishReason) -> RequestEvent | None: ...

    def retry_after(self) -> float: ...

    def progress(self, request_id: str) -> dict[str, Any] | None: ...


class TokenizerLike(Protocol):
    """What the engine and the HTTP layer need from a tokenizer."""

    eos_token_ids: frozenset[int]
    vocab_size: int
    bos_token_id: int | None

    @property
    def special_token_ids(self) -> frozenset[int]: ...   # ids that skip_special_tokens drops

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...   # the exact bytes one token stands for (b"": none)

    def token_str(self, token_id: int) -> str: ...       # one token as text, for logprobs and /tokenize

    @property
    def chat_template(self) -> str | None: ...           # the jinja template in use (None: the model has none)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **options: Any) -> list[int]: ...   # prompt ids; options as Tokenizer's
