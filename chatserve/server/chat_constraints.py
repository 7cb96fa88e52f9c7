"""A chat request's structured-output and tool fields → what the prompt, the sampler and the reply need.

One call from the request parser (`chat_constraints`): validates `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls` and tool history, compiles the grammar (cached), and says which
messages and tools go to the chat template. Raises APIError 400 before anything is queued.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatserve.server.errors import APIError, invalid
from chatserve.server.schemas.openai import ChatCompletionRequest, ChatMessage
from chatserve.structured.compiler import GrammarError, compiler_for
from chatserve.structured.response_format import RequestFieldError, response_format_spec
from chatserve.structured.spec import StructuredSpec
from chatserve.toolcalls.parsers import default_parser_name
from chatserve.toolcalls.prompt import fallback_messages, template_knows_tools
from chatserve.toolcalls.request import ToolPlan, tool_plan

if TYPE_CHECKING:
    from chatserve.server.served_model import ServedModel

HANDLED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


@dataclass
class ChatConstraints:
    messages: list[dict]                   # what the chat template renders
    template_tools: list[dict] | None      # `tools` for the template (None: not passed)
    spec: StructuredSpec | None            # compiled output constraint for SamplingParams.structured
    tools: ToolPlan | None                 # how to read tool calls back (None: no tools)


def model_vocab_size(served: ServedModel) -> int:
    """The width of the model's logits (a grammar's bitmask covers exactly this many tokens)."""
    runner = served.engine.runner            # None only before the engine has loaded
    v = runner.vocab_size if runner is not None else 0
    return v if v > 0 else int(served.vocab_size or served.tokenizer.vocab_size)


def tool_message_fields(m: ChatMessage) -> dict:
    """The tool fields of one validated history message, as the chat template takes them: `tool_calls` on
    assistant turns, `tool_call_id` (and `name`) on tool results."""
    out: dict = {}
    if m.role == "assistant" and m.tool_calls is not None:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments or "{}"}}
                             for c in m.tool_calls]
    if m.role == "tool":
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
    return out


def chat_constraints(r: ChatCompletionRequest, messages: list[dict], served: ServedModel) -> ChatConstraints:
    """Check and compile the validated request's constraint fields (the inner shapes of `tools` and
    `response_format`, which the schema leaves open). Raises APIError (400) naming the problem."""
    template = served.chat_template
    try:
        spec = response_format_spec(r.response_format)
        parser = served.config.server.tool_call_parser or default_parser_name(template)
        plan = tool_plan(r.tools, r.tool_choice, r.parallel_tool_calls, parser)
    except RequestFieldError as e:
        raise invalid(str(e), e.param) from None
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    tools = plan.tools if plan is not None and plan.active else None    # the tools the template shows
    active = tools is not None
    if plan is not None and plan.constraint is not None:
        spec = plan.constraint                      # a forced call: its grammar wins
    if template_knows_tools(template):
        msgs, template_tools = messages, tools
    elif active or has_history:
        msgs, template_tools = fallback_messages(messages, tools), None
    else:
        msgs, template_tools = messages, None
    if spec is not None:
        try:
            spec = compiler_for(served.tokenizer, model_vocab_size(served)).compile(spec)
        except GrammarError as e:
            param = "tools" if plan is not None and plan.constraint is not None else "response_format"
            raise APIError(400, str(e), param=param, code="invalid_grammar") from None
    return ChatConstraints(msgs, template_tools, spec, plan if active else None)
