"""Admission checks: a group of samples of one prompt is refused at the door when it is malformed
(ValueError: a caller's bug) or can never run (`AdmissionError` with its `ErrorCode`).

Pure functions over plain ints; the waiting-queue bound (503) is the scheduler's, which alone knows the queue.
"""
from __future__ import annotations

from collections.abc import Container

from chatserve.core.errors import ErrorCode
from chatserve.core.request import Request


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
