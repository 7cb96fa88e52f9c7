"""Request and response models of the OpenAI-compatible routes (chat, completions, models, tokenize).

Requests are strict (no type coercion, unknown fields refused); each limit lives here once and is both
enforced and published in /openapi.json. Not the rules that need the model or tokenizer (protocol.py).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

MAX_N = 16
MAX_STOP = 16
MAX_STOP_LEN = 512
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_USER_CHARS = 256
MAX_BATCH_SAMPLES = 64       # prompts × (best_of or n) in one completions request
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
# Sampling bounds keep every logit finite in float32: logits / repetition_penalty stays below ~1e5.
MIN_REPETITION_PENALTY = 0.01


def _integral(v: Any) -> Any:
    """JSON Schema counts 7.0 as an integer: accept it as 7 (1.5 and true stay type errors)."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 64:
        return int(v)
    return v


_INTEGRAL = BeforeValidator(_integral)
# integer field types with bounds (the bounds go before the validator so the schema shows them)
NonNegativeInt = Annotated[int, Field(ge=0), _INTEGRAL]
PositiveInt = Annotated[int, Field(ge=1), _INTEGRAL]
TopK = Annotated[int, Field(ge=-1), _INTEGRAL]
ChoiceCount = Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), _INTEGRAL]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), _INTEGRAL]
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True}), _INTEGRAL]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LEN)]
LogitBiasKey = Annotated[str, StringConstraints(pattern=r"^\s*[0-9]{1,9}\s*$")]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Open(BaseModel):
    """Response shapes: documented fields, and clients must tolerate more."""
    model_config = ConfigDict(extra="allow")


# ── messages ─────────────────────────────────────────────────────────────────────────────────────
class TextPart(Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict):
    """One message. `name`, assistant `tool_calls` and `role: tool` go to the chat template as they are."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="an assistant turn's reasoning, replayed: handed "
                                          "to the chat template (which keeps or drops it)")
    reasoning: str | None = Field(None, description="the same as reasoning_content (newer vLLM's name)")


class StreamOptions(Strict):
    include_usage: bool = False


# ── the fields chat and completions share ─────────────────────────────────────────────────────────
class SamplingFields(Strict):
    model: str | None = None
    # Ollama's keep_alive: how long the model stays loaded after this request ("5m", seconds, 0 = unload
    # at once, negative = keep); checked by prompt_guard.requested_model
    keep_alive: str | float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    n: ChoiceCount = 1
    max_tokens: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0, le=2, description="0 (and anything below 1e-5) is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = Field(0, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=2)
    seed: Seed | None = None
    logit_bias: dict[LogitBiasKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: NonNegativeInt = Field(0, description="EOS and stop token ids are masked until this many "
                            "tokens are generated")
    skip_special_tokens: bool = True
    user: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = Field(
        None, description="echoed nowhere; logged with the request id")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = Field(None, description="needs logprobs: true")
    prompt_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="render the last (assistant) message open, "
                                         "to be continued; excludes add_generation_prompt")
    chat_template: Annotated[str, StringConstraints(max_length=65536)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Structured outputs and tools: checked and compiled by chatserve/structured (chat_constraints).
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="none (or minimal): the template's thinking switch off (enable_thinking=false); "
        "low/medium/high: on. chat_template_kwargs.enable_thinking, when set, wins")
    # OpenAI fields that change nothing about the output: accepted (service_tier is echoed)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted, no effect; the response says 'default'")
    metadata: Annotated[dict[str, Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="accepted, not stored")
    store: bool | None = Field(None, description="accepted; chat completions are not stored")
    prompt_cache_key: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        None, description="accepted; prefix caching is automatic")
    safety_identifier: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = Field(
        None, description="accepted, logged like user")
    modalities: list[Literal["text"]] | None = Field(None, description="text only")


class CompletionRequest(SamplingFields):
    prompt: Union[Annotated[str, StringConstraints(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[str, StringConstraints(min_length=1)]],
                            Field(min_length=1, max_length=MAX_BATCH_SAMPLES)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1, max_length=MAX_BATCH_SAMPLES)]] = Field(
        description=f"one prompt or a batch; prompts × (best_of or n) ≤ {MAX_BATCH_SAMPLES}")
    max_tokens: NonNegativeInt | None = Field(None, description="default 16; 0 only with echo")
    echo: bool = False
    best_of: ChoiceCount | None = Field(None, description="n <= best_of; the best n by "
                                "cumulative logprob are returned (not with stream)")
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None
    suffix: Annotated[str, StringConstraints(max_length=0)] | None = Field(None, description="not supported")


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Annotated[str, StringConstraints(max_length=65536)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


# ── responses ─────────────────────────────────────────────────────────────────────────────────────
class ErrorBody(Open):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Open):
    error: ErrorBody


class PromptTokensDetails(Open):
    cached_tokens: int = 0


class CompletionTokensDetails(Open):
    reasoning_tokens: int = 0


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    chatserve: dict[str, float | None] | None = Field(None, description="extension: ttft_s, tokens_per_s, "
                                                       "queue_s")


class TopLogprob(Open):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Open):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(Open):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="the model's reasoning (think block), apart "
                                          "from content; null when the model did not reason")
    reasoning: str | None = Field(None, description="the same as reasoning_content")


class ChatChoice(Open):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: Union[int, str, None] = Field(None, description="the stop string or token id that "
                                               "ended the choice; null for EOS or length")


class ChatCompletion(Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ChunkDelta(Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, description="a piece of the reasoning; reasoning chunks "
                                          "come before the content")
    reasoning: str | None = None


class ChunkChoice(Open):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(Open):
    """One `data:` event of a chat stream. The first chunk of a choice carries the role and its first
    text; the last one (choices == []) carries usage when stream_options.include_usage is set."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(Open):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class Completion(Open):
    """A completion, or (object "text_completion" too) one `data:` event of a completions stream."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # max_tokens of a request that sets none (--max-tokens-default or the model's generation config);
    # null = the rest of the context, as OpenAI does
    max_tokens_default: int | None = None
    # the model's recommended sampling for fields a request leaves unset (--generation-config: its
    # generation_config.json or GGUF general.sampling.* keys); {} = OpenAI's defaults
    sampling_defaults: dict[str, float] = {}
    # the chat template has a thinking switch (enable_thinking; reasoning_effort "none" turns it off)
    thinking_switch: bool = False
    # whether it is in memory now: loaded, loading, unloading or unloaded (a request loads it)
    status: Literal["loaded", "loading", "unloading", "unloaded"] = "loaded"
    # bytes it takes loaded (weights as stored + its KV cache share); 0 = unknown
    size_bytes: int = 0


class ModelList(Open):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(Open):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(Open):
    prompt: str


class Status(Open):
    status: str
    model: str | None = None


class ResetPrefixCacheResponse(Open):
    reset: bool
