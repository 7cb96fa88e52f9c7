"""OpenAI request bodies → typed requests with SamplingParams and prompt token ids.

Types, ranges and unknown fields are checked by the pydantic models (schemas/openai.py); this module adds
the rules that need the served model (vocabulary, context length, chat template) and maps every failure
to a 400/404 APIError naming the offending `param`. Not HTTP reading (body.py), not formatting (chat_service.py).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from chatserve.core.request import SamplingParams
from chatserve.server.errors import APIError, invalid
from chatserve.server.schemas import openai as s
from chatserve.server.schemas.openai import MAX_N, MAX_STOP, MAX_STOP_LEN, MAX_TOP_LOGPROBS  # noqa: F401
from chatserve.reasoning import needs_special_tokens, thinking_switch
from chatserve.server.chat_constraints import chat_constraints, tool_message_fields
from chatserve.toolcalls.prompt import with_object_arguments
from chatserve.server.reasoning_plan import ReasoningPlan, reasoning_plan, replayed_reasoning, with_thinking_field
from chatserve.toolcalls.request import ToolPlan

GREEDY_BELOW = 1e-5          # temperatures under this sample greedily (dividing by them overflows float32)

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

if TYPE_CHECKING:
    from chatserve.server.model_registry import ModelLease
    from chatserve.server.served_model import ServedModel


@dataclass
class GenerationRequest:
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    request_id: str = ""
    user: str | None = None
    served: ServedModel | None = None     # the model it was parsed for (tokenizer, engine)
    lease: ModelLease | None = None       # the hold on that model until the engine has it (prompt_guard.admit)

    @property
    def served_model(self) -> ServedModel:
        """The served model (every parsed request has one)."""
        assert self.served is not None
        return self.served

    def release(self) -> None:
        """Give the model lease back (idempotent): once submitted, the engine's live request keeps the
        model loaded."""
        if self.lease is not None:
            self.lease.release()


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = field(default_factory=list)   # normalized: {"role", "content": str, ...}
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None                   # vLLM's top-level prompt_logprobs
    tools: ToolPlan | None = None                        # tool calls to read back from the output
    reasoning: ReasoningPlan | None = None               # how to tell reasoning from the answer
    service_tier: str | None = None                      # echoed ("default") when the client sent one


@dataclass
class CompletionRequest(GenerationRequest):
    prompt_text: str | None = None
    logprobs: int | None = None
    # more than one prompt: (ids, text) of each, prompt_ids/prompt_text being the first; choice index
    # of prompt p, sample j is p * n + j (as vLLM and OpenAI)
    prompts: list[tuple[list[int], str | None]] = field(default_factory=list)
    echo: bool = False
    best_of: int | None = None         # generate best_of, return the n with the highest cumulative logprob
    n: int = 1                         # choices returned per prompt (params.n is best_of when that is set)
    prompt_logprobs: int | None = None  # vLLM's per-choice prompt_logprobs (echo uses `logprobs`)


# ---- pydantic → the OpenAI error object ---------------------------------------------------------
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "function-after",
               "function-before", "constrained-str", "constrained-int"}
_WHOLE_FIELD = {"logit_bias", "chat_template_kwargs", "stop", "stop_token_ids", "prompt", "tools",
                "response_format", "tool_choice", "tokens"}


def _param(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') → 'messages[0].content'; dict keys and union tags dropped."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if part in _UNION_TAGS or "[" in part or "-" in part or (i and not part.isidentifier()):
            break
        out += ("." if out else "") + part
        if i == 0 and part in _WHOLE_FIELD:
            break
    return out or None


def _is_type_error(t: str) -> bool:
    return t.endswith("_type") or t in ("union_tag_invalid", "is_instance_of", "model_attributes_type")


def from_validation_error(e: ValidationError) -> APIError:
    errs = e.errors(include_url=False)
    err = next((x for x in errs if not _is_type_error(x["type"])), errs[0])   # a union's real complaint
    param = _param(tuple(err["loc"]))
    name = param or "body"
    if err["type"] == "missing":
        return invalid(f"'{name}' is required", param, "missing_required_parameter")
    if err["type"] == "extra_forbidden":
        return invalid(f"'{name}' is not supported by this server", param, "unsupported_parameter")
    code = "invalid_type" if _is_type_error(err["type"]) else "invalid_value"
    return invalid(f"'{name}': {err['msg']}"[:500], param, code)


def validate(model: type[M], body: Any) -> M:
    """The body as `model`, or a 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- shared parts ---------------------------------------------------------------------------------
def check_token_ids(ids: list[int], param: str, vocab_size: int | None) -> list[int]:
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise invalid(f"'{param}' contains token id {t} outside the vocabulary", param)
    return list(ids)


def _logit_bias(v: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    out: dict[int, float] = {}
    for k, b in (v or {}).items():
        tid = int(k.strip())
        if vocab_size is not None and tid >= vocab_size:
            raise invalid(f"'logit_bias' token id {tid} is outside the vocabulary", "logit_bias")
        out[tid] = float(b)
    return out or None


# Fields a model's generation config may default (chatserve/generation_defaults.py), when the client left them unset.
_MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(r: s.SamplingFields, served: ServedModel, *, n: int,
                    logprobs: int | None) -> SamplingParams:
    """The sampling fields shared by chat and completions (max_tokens is set by the caller). A field the
    client did not send takes the model's generation-config value when it ships one (--generation-config)."""
    defaults = {k: v for k, v in served.sampling_defaults.items()
                if k in _MODEL_DEFAULTED and k not in r.model_fields_set}
    if defaults:
        r = r.model_copy(update=defaults)
    vocab = served.vocab_size
    temperature = 0.0 if r.temperature < GREEDY_BELOW else r.temperature
    top_k = 0 if r.top_k == -1 else r.top_k
    if vocab and top_k > vocab:
        raise invalid(f"'top_k' must be at most the vocabulary size {vocab}, got {top_k}", "top_k")
    stop = [] if r.stop is None else ([r.stop] if isinstance(r.stop, str) else list(r.stop))
    return SamplingParams(
        n=n, temperature=temperature, top_p=r.top_p, top_k=top_k, min_p=r.min_p,
        repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty, seed=r.seed, logit_bias=_logit_bias(r.logit_bias, vocab),
        logprobs=logprobs, stop=stop,
        stop_token_ids=check_token_ids(r.stop_token_ids or [], "stop_token_ids", vocab),
        ignore_eos=r.ignore_eos, include_stop_str_in_output=r.include_stop_str_in_output,
        min_tokens=r.min_tokens, skip_special_tokens=r.skip_special_tokens,
        min_tokens_banned_ids=_min_tokens_banned(r, served),
    )


def _min_tokens_banned(r: s.SamplingFields, served: ServedModel) -> list[int]:
    """The ids min_tokens holds back: the stop token ids and (unless ignore_eos) the model's EOS ids."""
    if not r.min_tokens:
        return []
    eos = [] if r.ignore_eos else list(served.tokenizer.eos_token_ids)
    return sorted(set(r.stop_token_ids or []) | set(eos))


def max_tokens_for(requested: tuple[str, int | None], where: str, prompt_len: int, max_model_len: int,
                   kv_tokens: int = 0, default: int | None = None) -> int:
    """The validated (field name, value) of max_tokens / max_completion_tokens checked against the context;
    default = `default` (--max-tokens-default or the model's generation config) capped by the room left,
    else the rest of the context (and of the whole KV cache, `kv_tokens`, when that is smaller), as OpenAI
    does. `where` names the prompt's field for a prompt that leaves no room."""
    key, mt = requested
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens, but this model's context is "
                       f"{max_model_len} tokens: nothing is left to generate", param=where,
                       code="context_length_exceeded")
    if mt is None:
        if kv_tokens:
            room = min(room, kv_tokens - prompt_len)
            if room < 1:
                raise APIError(400, f"the prompt is {prompt_len} tokens; the whole KV cache holds "
                               f"{kv_tokens}", param=where, code="context_length_exceeded")
        return min(room, default) if default else room
    if prompt_len + mt > max_model_len:
        raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt is "
                       f"{prompt_len} and {key} is {mt} ({prompt_len + mt} in all)",
                       param=key, code="context_length_exceeded")
    return mt


def _stream_flags(r: s.SamplingFields) -> tuple[bool, bool]:
    if r.stream_options is not None and not r.stream:
        raise invalid("'stream_options' is only allowed with stream: true", "stream_options")
    return r.stream, bool(r.stream_options and r.stream_options.include_usage)


# ---- chat -----------------------------------------------------------------------------------------
def normalize_messages(messages: list[s.ChatMessage]) -> list[dict]:
    """The validated messages as the chat template gets them: content folded to one string, developer →
    system; `name`, `tool_calls` and `tool_call_id` passed on where they belong. The shapes were checked
    by the schema (schemas/openai.ChatMessage); what is left are the rules between fields."""
    out = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if m.tool_calls is not None and m.role != "assistant":
            raise invalid(f"{p}.tool_calls must be a list of objects on an assistant message",
                          f"{p}.tool_calls", "invalid_type")
        content = "".join(part.text for part in m.content) if isinstance(m.content, list) else m.content
        extra = tool_message_fields(m)
        if content is None:
            if not extra.get("tool_calls"):
                raise invalid(f"{p}.content must be a string or a list of text parts", f"{p}.content",
                              "invalid_type")
            content = ""                   # an assistant turn that only calls tools
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        msg.update(replayed_reasoning(m, p))
        msg.update(extra)                  # tool_calls / tool_call_id
        out.append(msg)
    return out


def template_options(r: s.ChatCompletionRequest | s.TokenizeRequest,
                     tokenizer_template: str | None = None) -> dict[str, Any]:
    """Keyword arguments for tokenizer.apply_chat_template: only what the client set, so a tokenizer
    without `chat_template`/`continue_final_message` keeps working for everyone else."""
    set_ = r.model_fields_set
    cont = r.continue_final_message
    add_gen = r.add_generation_prompt if "add_generation_prompt" in set_ else not cont
    if cont and add_gen:
        raise invalid("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                      "continue_final_message")
    kw: dict[str, Any] = {"add_generation_prompt": add_gen}
    if cont:
        kw["continue_final_message"] = True
    if r.chat_template is not None:
        kw["chat_template"] = r.chat_template
    if isinstance(r, s.ChatCompletionRequest):
        kw.update(thinking_switch(r.reasoning_effort, r.chat_template or tokenizer_template))
    for k, v in (r.chat_template_kwargs or {}).items():
        if k in ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "tools",
                 "prefix_ids"):
            raise invalid(f"'chat_template_kwargs' must not set {k!r}", "chat_template_kwargs")
        kw[k] = v
    return kw


def render_prompt(served: ServedModel, messages: list[dict], options: dict[str, Any]) -> list[int]:
    if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
        raise invalid("'continue_final_message' needs an assistant message last", "continue_final_message")
    template = options.get("chat_template") or served.chat_template
    messages = with_object_arguments(messages, template)     # a template that tojson's them: no double quoting
    messages = with_thinking_field(messages, template)
    try:
        ids = list(served.tokenizer.apply_chat_template(messages, **options))
    except TypeError as e:
        raise invalid(f"this server's tokenizer does not take that option yet: {e}"[:500],
                      "chat_template_kwargs") from None
    except ValueError as e:
        raise invalid(f"invalid messages: {e}"[:500], "messages") from None
    if not ids:
        raise invalid("the messages produce an empty prompt", "messages")
    return ids


def _parse_body(model: type[M], body: dict, served: ServedModel,
                parse: Callable[[M, ServedModel], R]) -> R:
    """`body` validated as `model` (once: `parse` reads only the model), then `parse(r, served)`; an APIError
    passes through, anything else it raises becomes a 400 (whatever unforeseen thing user input trips is
    still the input's fault)."""
    r = validate(model, body)
    try:
        return parse(r, served)
    except APIError:
        raise
    except Exception as e:
        raise invalid(f"invalid request: {type(e).__name__}: {e}"[:500], None, "invalid_request") from e


def parse_chat_body(body: dict, served: ServedModel) -> ChatRequest:
    """Validate a /v1/chat/completions body and tokenize it with the chat template."""
    return _parse_body(s.ChatCompletionRequest, body, served, _parse_chat)


def _parse_chat(r: s.ChatCompletionRequest, served: ServedModel) -> ChatRequest:
    model = r.model if r.model is not None else served.name
    messages = normalize_messages(r.messages)
    stream, include_usage = _stream_flags(r)
    _check_prompt_logprobs(r.prompt_logprobs, stream)
    if r.top_logprobs is not None and not r.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    params = sampling_params(r, served, n=r.n, logprobs=(r.top_logprobs or 0) if r.logprobs else None)
    constraints = chat_constraints(r, messages, served)      # response_format, tools: 400s first
    options = template_options(r, served.chat_template)
    if constraints.template_tools:
        options["tools"] = constraints.template_tools
    prompt_ids = render_prompt(served, constraints.messages, options)
    plan = reasoning_plan(served, r.chat_template, prompt_ids)
    requested = (("max_completion_tokens", r.max_completion_tokens) if r.max_completion_tokens is not None
                 else ("max_tokens", r.max_tokens))
    params.max_tokens = max_tokens_for(requested, "messages", len(prompt_ids), served.max_model_len,
                                       served.kv_tokens, served.default_max_tokens)
    _check_min_tokens(params)
    params.structured = plan.gate(constraints.spec) if plan is not None else constraints.spec
    if ((plan is not None and needs_special_tokens(plan.parser_name))
            or (constraints.tools is not None and constraints.tools.parser_name == "gpt_oss")):
        params.skip_special_tokens = False      # harmony's channels are special tokens: the parsers read them
    params.prompt_logprobs = r.prompt_logprobs
    return ChatRequest(model=model, prompt_ids=prompt_ids, params=params, stream=stream, served=served,
                       include_usage=include_usage, request_id=new_id("chatcmpl"), messages=messages,
                       logprobs=r.logprobs, top_logprobs=r.top_logprobs or 0, user=r.user or r.safety_identifier,
                       tools=constraints.tools, prompt_logprobs=r.prompt_logprobs, reasoning=plan,
                       service_tier="default" if r.service_tier is not None else None)


def _check_prompt_logprobs(k: int | None, stream: bool) -> None:
    if k is not None and stream:          # as vLLM: they are a response-level list, not a delta
        raise invalid("'prompt_logprobs' are not available with stream: true", "prompt_logprobs")


def _check_min_tokens(params: SamplingParams) -> None:
    if params.min_tokens > params.max_tokens:
        raise invalid(f"'min_tokens' ({params.min_tokens}) is more than max_tokens ({params.max_tokens})",
                      "min_tokens")


# ---- completions ----------------------------------------------------------------------------------
def parse_completion_body(body: dict, served: ServedModel) -> CompletionRequest:
    """Validate a /v1/completions body and tokenize its prompt(s)."""
    return _parse_body(s.CompletionRequest, body, served, _parse_completion)


def _prompts(r: s.CompletionRequest, served: ServedModel) -> list[tuple[list[int], str | None]]:
    p = r.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        items: list = [p]
    else:
        items = list(p)
    out: list[tuple[list[int], str | None]] = []
    for item in items:
        if isinstance(item, str):
            ids = list(served.tokenizer.encode(item))
            if not ids:
                raise invalid("'prompt' produces no tokens", "prompt")
            out.append((ids, item))
        else:
            out.append((check_token_ids(item, "prompt", served.vocab_size), None))
    return out


def _parse_completion(r: s.CompletionRequest, served: ServedModel) -> CompletionRequest:
    model = r.model if r.model is not None else served.name
    prompts = _prompts(r, served)
    stream, include_usage = _stream_flags(r)
    _check_prompt_logprobs(r.prompt_logprobs, stream)
    n = r.n
    best_of = r.best_of
    if best_of is not None:
        if best_of < n:
            raise invalid(f"'best_of' ({best_of}) must be at least n ({n})", "best_of")
        if stream and best_of != n:
            raise invalid("'best_of' cannot be used with stream", "best_of")
    if len(prompts) * (best_of or n) > s.MAX_BATCH_SAMPLES:
        raise invalid(f"{len(prompts)} prompts × {best_of or n} samples is more than the "
                      f"{s.MAX_BATCH_SAMPLES} one request may ask for", "prompt")
    params = sampling_params(r, served, n=best_of or n, logprobs=r.logprobs)
    if best_of is not None and best_of > n and params.logprobs is None:
        params.logprobs = 0                 # ranking needs each sampled token's logprob
    longest = max(len(ids) for ids, _ in prompts)
    if r.max_tokens == 0:
        if not r.echo:
            raise invalid("'max_tokens' may be 0 only with echo", "max_tokens")
    mt = r.max_tokens
    if mt is None:
        # OpenAI's default is 16; an operator's or the model's default (--max-tokens-default) wins
        mt = min(served.default_max_tokens or 16, max(1, served.max_model_len - longest))
    params.max_tokens = max_tokens_for(("max_tokens", mt), "prompt", longest, served.max_model_len,
                                       served.kv_tokens, served.default_max_tokens) if mt != 0 else 0
    _check_min_tokens(params)
    # the prompt's logprobs, for vLLM's prompt_logprobs and for echo with logprobs (OpenAI's legacy way)
    wanted = [k for k in (r.prompt_logprobs, r.logprobs if r.echo else None) if k is not None]
    params.prompt_logprobs = max(wanted) if wanted else None
    ids, text = prompts[0]
    return CompletionRequest(model=model, prompt_ids=ids, params=params, stream=stream, served=served,
                             include_usage=include_usage, request_id=new_id("cmpl"), prompt_text=text,
                             logprobs=r.logprobs, prompts=prompts, echo=r.echo,
                             best_of=best_of if best_of and best_of > n else None, n=n,
                             user=r.user, prompt_logprobs=r.prompt_logprobs)
