"""Validation of OpenAI request bodies into typed requests with SamplingParams and prompt token ids.

Every rule answers 400/404 with an APIError naming the offending `param`; nothing is truncated.
Not HTTP reading (body.py) and not response formatting (chat_service.py).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from chatserve.core.request import SamplingParams
from chatserve.server.errors import APIError, invalid
from chatserve.structured.chat_request import chat_constraints, tool_message_fields
from chatserve.tools.request import ToolPlan

MAX_N = 16
MAX_STOP = 16
MAX_STOP_LEN = 512
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


@dataclass
class GenerationRequest:
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    request_id: str = ""


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = field(default_factory=list)   # normalized: {"role", "content": str}
    logprobs: bool = False
    top_logprobs: int = 0
    tools: ToolPlan | None = None                        # tool calls to read back from the output


@dataclass
class CompletionRequest(GenerationRequest):
    prompt_text: str | None = None
    logprobs: int | None = None


# ---- field helpers --------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, key: str) -> Any:
    v = body.get(key)
    return None if v is None else v


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = _opt(body, key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def get_int(body: dict, key: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = _opt(body, key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63:
        v = int(v)                         # JSON Schema: 7.0 is an integer
    if not _is_int(v):
        raise invalid(f"'{key}' must be an integer", key, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise invalid(f"'{key}' must be in {rng}, got {v}", key)
    return v


def get_float(body: dict, key: str, default: float, lo: float, hi: float, *,
              lo_open: bool = False) -> float:
    v = _opt(body, key)
    if v is None:
        return default
    if not _is_num(v):
        raise invalid(f"'{key}' must be a number", key, "invalid_type")
    v = float(v)
    if v != v or v > hi or v < lo or (lo_open and v == lo):
        raise invalid(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return v


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- shared parts ---------------------------------------------------------------------------------
def check_model(body: dict, state) -> str:
    m = body.get("model")
    if m is None:
        return state.model_name
    if not isinstance(m, str):
        raise invalid("'model' must be a string", "model", "invalid_type")
    if m not in state.model_names():
        raise APIError(404, f"the model '{m[:200]}' does not exist; this server serves "
                       f"'{state.model_name}'", param="model", code="model_not_found")
    return m


def parse_stop(body: dict) -> list[str]:
    v = _opt(body, "stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise invalid("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} strings", "stop")
    for s in items:
        if not isinstance(s, str):
            raise invalid("'stop' must contain only strings", "stop", "invalid_type")
        if not s:
            raise invalid("'stop' strings must not be empty", "stop")
        if len(s) > MAX_STOP_LEN:
            raise invalid(f"'stop' strings are at most {MAX_STOP_LEN} characters", "stop")
    return list(items)


def parse_logit_bias(body: dict, vocab_size: int | None) -> dict[int, float] | None:
    v = _opt(body, "logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to numbers", "logit_bias",
                      "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        ks = k.strip()
        if not (ks.isascii() and ks.lstrip("-").isdigit()) or len(ks) > 12:
            raise invalid(f"'logit_bias' key {k[:40]!r} is not a token id", "logit_bias")
        tid = int(ks)
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            raise invalid(f"'logit_bias' token id {tid} is outside the vocabulary", "logit_bias")
        if not _is_num(b) or not (-100.0 <= float(b) <= 100.0):
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100]", "logit_bias")
        out[tid] = float(b)
    return out or None


def parse_token_ids(v: Any, param: str, vocab_size: int | None) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise invalid(f"'{param}' must be a list of token ids", param, "invalid_type")
    for t in v:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise invalid(f"'{param}' contains token id {t} outside the vocabulary", param)
    return list(v)


def sampling_params(body: dict, state, *, n: int, logprobs: int | None) -> SamplingParams:
    """The sampling fields shared by chat and completions (max_tokens is set by the caller)."""
    vocab = state.vocab_size
    stop_ids = body.get("stop_token_ids")
    seed = get_int(body, "seed", None, *SEED_RANGE)
    return SamplingParams(
        n=n,
        temperature=get_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=get_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_top_k(body, vocab),
        min_p=get_float(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=get_float(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=seed,
        logit_bias=parse_logit_bias(body, vocab),
        logprobs=logprobs,
        stop=parse_stop(body),
        stop_token_ids=[] if stop_ids is None else parse_token_ids(stop_ids, "stop_token_ids", vocab)[:64],
        ignore_eos=get_bool(body, "ignore_eos"),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
    )


def _top_k(body: dict, vocab: int | None) -> int:
    k = get_int(body, "top_k", 0, -1, vocab if vocab else 1 << 20)
    return 0 if k in (None, -1) else int(k)


def parse_n(body: dict) -> int:
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = _opt(body, "best_of")
    if best_of is not None and best_of != n:
        raise invalid("'best_of' is not supported (it must equal n)", "best_of")
    return int(n or 1)


def max_tokens_for(body: dict, prompt_len: int, max_model_len: int, kv_tokens: int = 0) -> int:
    """max_tokens / max_completion_tokens checked against the context; default = the rest of it
    (and of the whole KV cache, `kv_tokens`, when that is smaller)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = get_int(body, key, None, 1, None)
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens, but this model's context is "
                       f"{max_model_len} tokens: nothing is left to generate",
                       param="messages" if "messages" in body else "prompt",
                       code="context_length_exceeded")
    if mt is None:
        if kv_tokens:
            room = min(room, kv_tokens - prompt_len)
            if room < 1:
                raise APIError(400, f"the prompt is {prompt_len} tokens; the whole KV cache holds "
                               f"{kv_tokens}", param="messages" if "messages" in body else "prompt",
                               code="context_length_exceeded")
        return room
    if prompt_len + mt > max_model_len:
        raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt is "
                       f"{prompt_len} and {key} is {mt} ({prompt_len + mt} in all)",
                       param=key, code="context_length_exceeded")
    return mt


def parse_stream(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream")
    so = _opt(body, "stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = get_bool(so, "include_usage") and stream     # ignored without stream
    return stream, include_usage


def _reject_unsupported(body: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        v = body.get(k)
        if v not in (None, [], False, "none", "auto") and not (k == "response_format" and
                                                                 isinstance(v, dict) and v.get("type") == "text"):
            raise invalid(f"'{k}' is not supported by this server", k, "unsupported_parameter")


# ---- chat -----------------------------------------------------------------------------------------
def normalize_messages(v: Any) -> list[dict]:
    if not isinstance(v, list):
        raise invalid("'messages' must be a list of message objects", "messages", "invalid_type")
    if not v:
        raise invalid("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{p} must be an object", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise invalid(f"{p}.role must be a string", f"{p}.role", "invalid_type")
        if role not in CHAT_ROLES:
            raise invalid(f"{p}.role {role[:40]!r} is not one of {sorted(CHAT_ROLES)}", f"{p}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"{p}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}",
                                  f"{p}.content", "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        extra = tool_message_fields(m, p)
        if content is None and extra.get("tool_calls"):
            content = ""                   # an assistant turn that only calls tools
        if not isinstance(content, str):
            raise invalid(f"{p}.content must be a string or a list of text parts", f"{p}.content",
                          "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content, **extra})
    return out


def parse_chat_body(body: dict, state) -> ChatRequest:
    """Validate a /v1/chat/completions body and tokenize it with the chat template."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    try:
        return _parse_chat(body, state)
    except APIError:
        raise
    except Exception as e:  # anything unforeseen in user input is still the input's fault
        raise invalid(f"invalid request: {type(e).__name__}: {e}"[:500], None, "invalid_request") from e


def _parse_chat(body: dict, state) -> ChatRequest:
    model = check_model(body, state)
    if "messages" not in body:
        raise invalid("'messages' is required", "messages", "missing_required_parameter")
    messages = normalize_messages(body["messages"])
    _reject_unsupported(body, ("functions", "function_call", "audio", "prediction"))
    constraints = chat_constraints(body, messages, state)
    stream, include_usage = parse_stream(body)
    n = parse_n(body)
    want_lp = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    params = sampling_params(body, state, n=n, logprobs=(top or 0) if want_lp else None)  # top alone: ignored
    add_gen = get_bool(body, "add_generation_prompt", True)
    try:
        tools = {"tools": constraints.template_tools} if constraints.template_tools else {}
        prompt_ids = list(state.tokenizer.apply_chat_template(constraints.messages, add_generation_prompt=add_gen,
                                                              **tools))
    except ValueError as e:
        raise invalid(f"invalid messages: {e}"[:500], "messages") from None
    if not prompt_ids:
        raise invalid("the messages produce an empty prompt", "messages")
    params.max_tokens = max_tokens_for(body, len(prompt_ids), state.max_model_len, state.kv_tokens)
    params.structured = constraints.spec
    return ChatRequest(model=model, prompt_ids=prompt_ids, params=params, stream=stream,
                       include_usage=include_usage, request_id=new_id("chatcmpl"), messages=messages,
                       logprobs=want_lp, top_logprobs=top or 0, tools=constraints.tools)


# ---- completions ----------------------------------------------------------------------------------
def parse_completion_body(body: dict, state) -> CompletionRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    try:
        return _parse_completion(body, state)
    except APIError:
        raise
    except Exception as e:
        raise invalid(f"invalid request: {type(e).__name__}: {e}"[:500], None, "invalid_request") from e


def _parse_completion(body: dict, state) -> CompletionRequest:
    model = check_model(body, state)
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("'prompt' is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    text: str | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        text = prompt
        ids = list(state.tokenizer.encode(prompt))
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = parse_token_ids(prompt, "prompt", state.vocab_size)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("batched prompts are not supported: send one prompt per request", "prompt")
    else:
        raise invalid("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    if not ids:
        raise invalid("'prompt' produces no tokens", "prompt")
    if get_bool(body, "echo"):
        raise invalid("'echo' is not supported", "echo", "unsupported_parameter")
    if body.get("suffix") not in (None, ""):
        raise invalid("'suffix' is not supported", "suffix", "unsupported_parameter")
    stream, include_usage = parse_stream(body)
    n = parse_n(body)
    lp = get_int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    params = sampling_params(body, state, n=n, logprobs=lp)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body = dict(body, max_tokens=min(16, max(1, state.max_model_len - len(ids))))  # OpenAI's default
    params.max_tokens = max_tokens_for(body, len(ids), state.max_model_len, state.kv_tokens)
    return CompletionRequest(model=model, prompt_ids=ids, params=params, stream=stream,
                             include_usage=include_usage, request_id=new_id("cmpl"), prompt_text=text,
                             logprobs=lp)
