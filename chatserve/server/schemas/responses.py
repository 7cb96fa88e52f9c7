"""Request and response models of /v1/responses (OpenAI's Responses API), as chatserve serves it.

Strict like the chat schema: unknown fields and unsupported values are a 400 naming the field. Fields that
change nothing about the output (metadata, service_tier, user, prompt_cache_key, …) are accepted; the
rest of OpenAI's (hosted tools, background, conversation, prompt templates) are refused. Not the
translation to a chat request (server/responses/inputs.py).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StringConstraints, Tag, field_validator

from chatserve.server.schemas.openai import MAX_USER_CHARS, NonNegativeInt, Open, PositiveInt, Strict

MAX_INPUT_ITEMS = 2048
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"


# ── input items ──────────────────────────────────────────────────────────────────────────────────
class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None       # output_text replayed by SDKs
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputText]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: str | None = None
    status: str | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """A reasoning output item replayed: handed to the template with the next assistant turn."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(v: Any) -> str | None:
    """An item's `type`; a message may leave it out (OpenAI's "easy" input message)."""
    if isinstance(v, dict):
        t = v.get("type", "message")
        return t if isinstance(t, str) else None
    return getattr(v, "type", None)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type)]


# ── tools, text format, reasoning ────────────────────────────────────────────────────────────────
class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormatText(Strict):
    type: Literal["text"]


class TextFormatJSONObject(Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(Strict):
    type: Literal["json_schema"]
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: Annotated[Union[TextFormatText, TextFormatJSONObject, TextFormatJSONSchema],
                      Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = Field(None, description="only medium (the model's own)")


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="none/minimal: the template's thinking switch off; low/medium/high: on")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted; the reasoning comes back whole as reasoning_text content")
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = Field(None, description="accepted; no obfuscation is sent")


class ResponsesRequest(Strict):
    model: str | None = None
    input: Union[Annotated[str, StringConstraints(min_length=1)],
                 Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]]
    instructions: str | None = Field(None, description="a system message first; not carried to a "
                                     "response that chains this one")
    previous_response_id: Annotated[str, StringConstraints(pattern=ID_PATTERN)] | None = None
    store: bool = Field(True, description="keep the response for GET and previous_response_id")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = Field(
        None, description="function tools only")
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = Field(
        None, description="accepted; reasoning comes back as plain text, without logprobs")
    truncation: Literal["disabled"] | None = Field(None, description="disabled: a prompt that does not fit "
                                                   "is a 400")
    background: Literal[False] | None = None
    metadata: Annotated[dict[str, Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="echoed and stored")
    user: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = None
    safety_identifier: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = None
    prompt_cache_key: Annotated[str, StringConstraints(max_length=1024)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    seed: NonNegativeInt | None = Field(None, description="chatserve extension: seeded sampling")

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        """An item type this server does not take is named in the 400 (not a union's type mismatch)."""
        if isinstance(v, list):
            for i, it in enumerate(v):
                t = _item_type(it)
                if isinstance(it, dict) and t not in ITEM_TYPES:
                    raise ValueError(f"input[{i}] has type {t!r}; this server takes {', '.join(ITEM_TYPES)} items")
        return v


# ── output ───────────────────────────────────────────────────────────────────────────────────────
class OutputText(Open):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: str
    content: list[OutputText]


class OutputFunctionCall(Open):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: str


class OutputReasoning(Open):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText] | None = None


class ResponseUsage(Open):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] | None = None
    output_tokens_details: dict[str, int] | None = None


class Response(Open):
    """A response object (GET /v1/responses/{id} returns the stored one); streamed as events whose
    `type` names them (response.created … response.completed), each with a sequence_number."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[Annotated[Union[OutputMessage, OutputFunctionCall, OutputReasoning], Field(discriminator="type")]]
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class ResponseDeleted(Open):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseStreamEvent(Open):
    """One event of a streamed response: `event: <type>` and `data: {json}` lines. Types:
    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.reasoning_text.delta/.done, response.output_text.delta/.done, response.function_call_arguments
    .delta/.done, response.content_part.done, response.output_item.done, response.completed (its
    response's status "incomplete" at max_output_tokens), error."""
    type: str
    sequence_number: int
    response: Response | None = None
