"""The one admission path from client text to prompt ids: rate limits, the request's model leased (loaded
on demand), a byte bound, then tokenizing where it cannot stall the event loop.

Every route that tokenizes client text calls `admit()` (HTTP chat and completions, the WebSocket, session
turns, responses). Not the validation rules (protocol.py) and not the engine queue (chat_service.submit).
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from chatserve.config import parse_duration
from chatserve.core.admission import AdmissionError
from chatserve.server.errors import admission_error, invalid
from chatserve.server.prompt_guard import BIG_INPUT_BYTES, param_of, prompt_bytes

if TYPE_CHECKING:
    from chatserve.server.protocol import GenerationRequest
    from chatserve.server.served_model import ServedModel
    from chatserve.server.state import ServerState

T = TypeVar("T", bound="GenerationRequest")   # a ChatRequest or a CompletionRequest


def check_text_size(served: ServedModel, body: dict) -> int:
    """Raise 400 context_length_exceeded when the body's prompt text cannot fit the model's context; its bytes."""
    nbytes = prompt_bytes(body)
    served.prompt_guard.check_size(nbytes, param_of(body))
    return nbytes


def requested_model(body: dict) -> tuple[str | None, float | None]:
    """The body's `model` (None: the default model) and `keep_alive` in seconds (Ollama's field: how
    long the model stays loaded after this request; None: the server's --keep-alive)."""
    model, keep_alive = body.get("model"), body.get("keep_alive")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model", "invalid_type")
    if keep_alive is None:
        return model, None
    try:
        if not isinstance(keep_alive, (str, int, float)):
            raise ValueError(f"not a duration: {keep_alive!r}")
        return model, parse_duration(keep_alive)
    except ValueError as e:
        raise invalid(f"'keep_alive': {e}", "keep_alive") from None


async def admit(state: ServerState, body: dict, build: Callable[[dict, Any], T], *, rate_key: str) -> T:
    """Rate-limit precheck → the request's model leased (loaded first if it is not: 404 unknown, 503 no
    room) → overload precheck → size bound → `build(body, served)` (validation + tokenizing; in a worker
    thread when the text is big) → charge the rate limiter with the request's real token cost.

    `build` returns a request with `prompt_ids` and `params` (max_tokens, n); it carries the lease until
    the engine has it (GenerationRequest.release). Raises APIError (400 too long, 404, 429, 503, or
    whatever `build` raises)."""
    model, keep_alive = requested_model(body)
    limiter = state.rate_limiter
    if limiter is not None:
        await limiter.check(rate_key)
    lease = await state.models.lease(model, keep_alive)
    try:
        served = lease.value
        try:
            served.engine.check_capacity()       # overloaded: refuse before tokenizing
        except AdmissionError as e:
            raise admission_error(e.code, e.message, e.retry_after) from None
        nbytes = check_text_size(served, body)
        if nbytes > BIG_INPUT_BYTES or body.get("response_format") or body.get("tools"):
            req = await asyncio.to_thread(build, body, served)     # big text, or a grammar to compile
        else:
            req = build(body, served)
        req.lease = lease
        if limiter is not None:
            await limiter.charge(rate_key, len(req.prompt_ids) + req.params.max_tokens * req.params.n)
    except BaseException:
        lease.release()
        raise
    return req
