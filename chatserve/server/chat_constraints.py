"""A chat request's structured-output and tool fields → what the prompt, the sampler and the reply need.

One call from the request parser (`chat_constraints`): validates `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls` and tool history, compiles the grammar (cached), and says which
messages and tools go to the chat template. Raises APIError 400 before anything is queued.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatserve.server.errors import APIError, invalid
from chatserve.structured.compiler import GrammarError, compiler_for
from chatserve.structured.response_format import RequestFieldError, response_format_spec
from chatserve.structured.spec import StructuredSpec
from chatserve.toolcalls.parsers import default_parser_name
from chatserve.toolcalls.prompt import fallback_messages, template_knows_tools
from chatserve.toolcalls.request import ToolPlan, tool_plan

if TYPE_CHECKING:
    from chatserve.server.state import ServerState

HANDLED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


@dataclass
class ChatConstraints:
    messages: list[dict]                   # what the chat template renders
    template_tools: list[dict] | None      # `tools` for the template (None: not passed)
    spec: StructuredSpec | None            # compiled output constraint for SamplingParams.structured
    tools: ToolPlan | None                 # how to read tool calls back (None: no tools)


def model_vocab_size(state: ServerState) -> int:
    """The width of the model's logits (a grammar's bitmask covers exactly this many tokens)."""
    runner = state.engine.runner            # None only before the engine has loaded
    v = runner.vocab_size if runner is not None else 0
    return v if v > 0 else int(state.vocab_size or state.tokenizer.vocab_size)


def tool_message_fields(m: dict, where: str) -> dict:
    """The tool fields of one history message, checked: `tool_calls` on assistant turns, `tool_call_id`
    (and `name`) on tool results. Raises APIError 400."""
    out: dict = {}
    role = m.get("role")
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise invalid(f"{where}.tool_calls must be a list of {{'id', 'type': 'function', 'function': "
                          "{'name', 'arguments'}}", f"{where}.tool_calls", "invalid_type")
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": c["function"].get("arguments") or "{}"}}
                             for c in calls]
    if role == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise invalid(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id", "invalid_type")
        if tid is not None:
            out["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def chat_constraints(body: dict, messages: list[dict], state: ServerState) -> ChatConstraints:
    """Validate and compile the request's constraint fields. Raises APIError (400) naming the problem."""
    try:
        spec = response_format_spec(body.get("response_format"))
        parser = state.config.server.tool_call_parser or default_parser_name(
            getattr(state.tokenizer, "chat_template", None))
        plan = tool_plan(body, parser)
    except RequestFieldError as e:
        raise invalid(str(e), e.param) from None
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    active = plan is not None and plan.active
    if plan is not None and plan.constraint is not None:
        spec = plan.constraint                      # a forced call: its grammar wins
    if template_knows_tools(getattr(state.tokenizer, "chat_template", None)):
        msgs, template_tools = messages, (plan.tools if active else None)
    elif active or has_history:
        msgs, template_tools = fallback_messages(messages, plan.tools if active else None), None
    else:
        msgs, template_tools = messages, None
    if spec is not None:
        try:
            spec = compiler_for(state.tokenizer, model_vocab_size(state)).compile(spec)
        except GrammarError as e:
            param = "tools" if plan is not None and plan.constraint is not None else "response_format"
            raise APIError(400, str(e), param=param, code="invalid_grammar") from None
    return ChatConstraints(msgs, template_tools, spec, plan if active else None)
