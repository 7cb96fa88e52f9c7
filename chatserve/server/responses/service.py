"""The Responses API's logic: a validated request → a chat request (with a stored chain's history) →
the chat chunk stream → response events, stored when `store` is on. Routes call `prepare` then `events`
(streamed) or `collect` (one body). Not the HTTP handlers (routes.py).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator

from chatserve.server.chat_service import stream_chat
from chatserve.server.errors import APIError, status_for
from chatserve.server.admission import admit
from chatserve.server.protocol import ChatRequest, parse_chat_body
from chatserve.server.responses.events import Event, ResponseBuilder
from chatserve.server.responses.inputs import (chat_body, input_messages, items_to_messages, response_message,
                                              response_param)
from chatserve.server.responses.store import ResponseStore
from chatserve.server.schemas.responses import ResponsesRequest

if TYPE_CHECKING:
    from chatserve.server.state import ServerState


@dataclass
class Prepared:
    r: ResponsesRequest
    chat: ChatRequest
    history: list[dict]            # the chain's messages before this request's input
    rid: str
    owner: str


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def store_of(state: ServerState) -> ResponseStore:
    if state.responses is None:
        raise APIError(503, "the response store is not available", code="store_unavailable")
    return state.responses


async def prepare(state: ServerState, r: ResponsesRequest, *, owner: str, rate_key: str) -> Prepared:
    """The chain's history loaded (404 for an unknown previous_response_id), the chat request built and
    admitted. Raises APIError naming the Responses field."""
    history: list[dict] = []
    if r.previous_response_id is not None:
        rec = await store_of(state).get(owner, r.previous_response_id)
        if rec is None:
            raise APIError(404, f"no response '{r.previous_response_id}' is stored for this caller",
                           param="previous_response_id", code="previous_response_not_found")
        history = rec["history"]
    try:
        chat = await admit(state, chat_body(r, history), parse_chat_body, rate_key=rate_key)
    except APIError as e:
        e.param, e.message = response_param(e.param), response_message(e.message)
        raise
    return Prepared(r, chat, history, new_response_id(), owner)


def _echo(p: Prepared) -> dict[str, Any]:
    """The request fields a response object repeats."""
    r = p.r
    fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {"type": "text"}
    return {"model": p.chat.model, "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id, "store": r.store, "temperature": r.temperature,
            "top_p": r.top_p, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "tool_choice": (r.tool_choice if isinstance(r.tool_choice, str) or r.tool_choice is None
                            else r.tool_choice.model_dump()) or "auto",
            "text": {"format": fmt}, "truncation": "disabled", "metadata": r.metadata or {},
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                          "summary": r.reasoning.summary if r.reasoning else None},
            "user": r.user, "service_tier": "default", "background": False}


async def events(state: ServerState, p: Prepared) -> AsyncGenerator[Event, None]:
    """The response's stream events. The chat stream's first chunk is awaited before response.created, so
    an admission error (503) is still an HTTP error; later failures end with an `error` event."""
    b = ResponseBuilder(p.rid, int(time.time()), _echo(p))
    chunks = stream_chat(state, p.chat, owner=p.owner, keep_warm=p.r.store, request_id=p.rid)
    try:
        first = await chunks.__anext__()
        for e in b.start():
            yield e
        for e in b.push(first):
            yield e
        async for c in chunks:
            for e in b.push(c):
                yield e
            if b.error is not None:
                return
        final = b.finish_events()
        if p.r.store:
            history = p.history + input_messages(p.r) + items_to_messages(b.output)
            await store_of(state).put(p.owner, p.rid, {"response": b.response(), "history": history})
        for e in final:
            yield e
    finally:
        await chunks.aclose()


async def collect(stream: AsyncIterator[Event], p: Prepared) -> dict:
    """A non-streamed response: the last event's response object (an `error` event is raised)."""
    last: dict | None = None
    async for e in stream:
        if e["type"] == "error":
            raise APIError(status_for(e.get("code")), e["message"], code=e.get("code"), type="server_error")
        last = e
    assert last is not None and "response" in last
    return last["response"]
