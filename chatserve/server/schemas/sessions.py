"""Request and response shapes of the /v1/sessions routes, for /openapi.json and the schema fuzz test.

A turn body is validated with TurnRequest itself (sessions/inputs.py); the other bodies are checked by
sessions/inputs.py with the same limits. Not the store and not the routes.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_TITLE_CHARS = 200
MAX_CONTENT_CHARS = 200_000
MAX_IMPORT_MESSAGES = 5_000


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class SessionParams(_Body):
    """Sampling defaults stored with a session and applied to each of its turns."""
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 64 - 1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = Field(
        None, description="the chat's thinking switch (\"none\": off) where the model's template has one")


class SessionSettings(_Body):
    """POST /v1/sessions and PATCH /v1/sessions/{sid}: every field optional."""
    title: Annotated[str, StringConstraints(max_length=MAX_TITLE_CHARS)] | None = None
    system_prompt: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = None
    params: SessionParams | None = None
    model: Annotated[str, StringConstraints(max_length=200)] | None = None


class StoredUsage(_Out):
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    queue_s: float | None = None
    reasoning_tokens: int | None = None
    reasoning_s: float | None = Field(None, description="seconds from the first reasoning text to the answer")


class StoredMessage(_Out):
    """One message of the active branch (docs/sessions-api.md): its id, parent and versions (◀ n/N ▶)."""
    id: str | None = None
    parent: str | None = None
    role: Literal["user", "assistant", "system"]
    content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)]
    reasoning_content: str | None = Field(None, description="an assistant reply's thinking, kept apart "
                                          "from its answer; the chat template decides if later prompts show it")
    created: float | None = None
    usage: StoredUsage | None = None
    finish_reason: str | None = Field(None, description="null while generating; \"interrupted\" when its "
                                      "server died mid-turn")
    status: Literal["generating"] | None = None
    versions: list[str] | None = Field(None, description="ids of this message's versions, oldest first")
    version: int | None = Field(None, description="this message's index in versions")


class ImportedMessage(_Body):
    role: Literal["user", "assistant", "system"]
    content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)]
    reasoning_content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = None
    created: float | None = None
    usage: dict[str, float] | None = None
    finish_reason: Annotated[str, StringConstraints(max_length=20)] | None = None


class SessionImport(SessionSettings):
    """POST /v1/sessions/import: a file written by GET /v1/sessions/{sid}/export (v1: one branch; v2:
    every version in `tree`, which wins when present)."""
    format: Literal["chatserve.session.v1", "chatserve.session.v2"] = "chatserve.session.v1"
    messages: Annotated[list[ImportedMessage], Field(max_length=MAX_IMPORT_MESSAGES)] = []
    tree: dict[str, Any] | None = Field(None, description='{"nodes": [messages with id and parent], '
                                        '"active": leaf id}')
    created: float | None = None
    updated: float | None = None


class TurnRequest(SessionParams):
    """POST /v1/sessions/{sid}/messages: a new user message (or an edit/regenerate), generated from the
    stored history with the session's params overridden by the sampling fields given here; streamed as
    chat.completion.chunk SSE events unless stream is false."""
    content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = None
    replace_from: Annotated[int, Field(ge=0, description="edit: a new version of messages[i] (a branch)")] | None = None
    edit_id: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = Field(
        None, description="edit by message id (instead of replace_from)")
    regenerate: bool | None = None
    stream: bool = True


class _SessionHead(_Out):
    title: str
    created: float
    updated: float
    model: str | None = None
    system_prompt: str = ""
    params: dict[str, Any] = {}


class SessionSummary(_SessionHead):
    id: str
    num_messages: int
    rev: int | None = None


class Session(_SessionHead):
    id: str
    messages: list[StoredMessage]
    generating: bool | None = None
    turn: dict[str, Any] | None = Field(None, description='the running turn: {"id", "message_id", "phase"}')
    rev: int | None = None


class BranchRequest(_Body):
    """POST /v1/sessions/{sid}/branch: make this message version active (◀ / ▶)."""
    message_id: Annotated[str, StringConstraints(min_length=1, max_length=64)]


class AttachRequest(_Body):
    """POST /v1/sessions/{sid}/attach: follow the running turn (no fields)."""


class SessionList(_Out):
    object: Literal["list"]
    data: list[SessionSummary]


class SessionExport(_SessionHead):
    format: Literal["chatserve.session.v1", "chatserve.session.v2"]
    tree: dict[str, Any] | None = None
    messages: list[StoredMessage]


class TurnResult(_Out):
    session_id: str
    index: int | None
    message: StoredMessage | None


class SessionDeleted(_Out):
    id: str
    object: Literal["session"]
    deleted: bool


class TurnCancelled(_Out):
    id: str
    cancelled: bool


class StoreStatus(_Out):
    persistent: bool
    degraded: bool | None = None
