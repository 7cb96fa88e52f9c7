"""Admission rules: a group of samples of one prompt is refused at the door when it is malformed
(ValueError: a caller's bug) or can never run (`AdmissionError` with its `ErrorCode`), and a queued
request waits while a running request prefills its long prefix. Pure functions over plain data.
"""
from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from chatserve.core.errors import ErrorCode
from chatserve.core.request import Request

if TYPE_CHECKING:  # used only through its attributes
    from chatserve.core.live_request import LiveRequest

# A waiting request waits for a running prefill of its prefix only when that saves at least this
# many tokens of prefill (~ one step of compute); a block or two of shared template is not worth a step.
PREFIX_WAIT_MIN_TOKENS = 128


class AdmissionError(Exception):
    """A request refused at the door, with its `ErrorCode`.

    INVALID_VALUE / CONTEXT_LENGTH_EXCEEDED: it can never fit (context length, whole KV cache, more
    samples than sequence slots). SERVER_OVERLOADED: the waiting queue is full; retry after
    `retry_after` seconds.
    """

    def __init__(self, code: ErrorCode, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


def check_group(reqs: list[Request], live_ids: Container[str]) -> None:
    """ValueError unless `reqs` is one prompt's samples: unique new ids and, for n > 1, one group_id,
    sample_index 0..n-1 and the same prompt."""
    if not reqs:
        raise ValueError("empty group")
    ids = [r.request_id for r in reqs]
    if len(set(ids)) != len(reqs) or any(i in live_ids for i in ids):
        raise ValueError(f"duplicate request id in {ids}")
    if len(reqs) > 1:
        leader = reqs[0]
        for i, r in enumerate(reqs):
            if r.group_id is None or r.group_id != leader.group_id or r.sample_index != i:
                raise ValueError("siblings need one group_id and sample_index 0..n-1")
            if r.prompt_token_ids != leader.prompt_token_ids:
                raise ValueError("siblings must share the prompt")


def check_fits(prompt_len: int, max_tokens: int, n: int, *, max_model_len: int, block_size: int,
               num_blocks: int, max_num_seqs: int) -> None:
    """AdmissionError unless n samples of a prompt_len-token prompt with up to max_tokens outputs can
    ever run: a non-empty prompt, within the context length, the whole KV cache and the sequence slots."""
    if prompt_len == 0:
        raise AdmissionError(ErrorCode.INVALID_VALUE, "the prompt is empty")
    if prompt_len + max_tokens > max_model_len:
        raise AdmissionError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
            f"({max_model_len} tokens)",
        )
    need_blocks = -(-(prompt_len + max_tokens) // block_size)
    if need_blocks > num_blocks:
        raise AdmissionError(
            ErrorCode.INVALID_VALUE,
            f"prompt + max_tokens needs {need_blocks} KV blocks, the whole cache has {num_blocks}",
        )
    if n > max_num_seqs:
        raise AdmissionError(ErrorCode.INVALID_VALUE, f"n={n} exceeds max_num_seqs={max_num_seqs}")


def prefix_in_flight(tokens: list[int], cache_salt: str | None, running: Iterable[LiveRequest],
                     block_size: int) -> bool:
    """A running request is still prefilling at least PREFIX_WAIT_MIN_TOKENS tokens of full blocks that
    `tokens` starts with: admitting them now would compute those twice (e.g. n chats sent at once with
    one long system prompt), so the request waits a step or two and then finds them in the prefix cache."""
    bs = block_size
    usable = (len(tokens) - 1) // bs * bs           # the full blocks (the last token is always computed)
    for o in running:
        prompt = o.req.prompt_token_ids
        start = o.req.num_computed_tokens // bs * bs   # o's first block not yet in the cache
        limit = min(usable, len(prompt) // bs * bs)
        if start + PREFIX_WAIT_MIN_TOKENS > limit or o.req.cache_salt != cache_salt:
            continue
        shared = start                                  # blocks o is about to compute that can be used
        while shared < limit and tokens[shared:shared + bs] == prompt[shared:shared + bs]:
            shared += bs
        if shared - start >= PREFIX_WAIT_MIN_TOKENS and tokens[:start] == prompt[:start]:
            return True
    return False
