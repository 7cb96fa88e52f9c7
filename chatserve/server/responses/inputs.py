"""A /v1/responses request → the chat-completions body the chat pipeline serves.

Input items (messages, function calls and their outputs, replayed reasoning) and a stored chain's history
become chat messages; tools, tool_choice, text.format and reasoning.effort become their chat fields.
Not storage (store.py) and not the output events (events.py).
"""
from __future__ import annotations

from typing import Any

from chatserve.server.schemas.responses import ResponsesRequest


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


def _reasoning_text(item: dict) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(p["text"] for p in parts if p.get("text"))


def items_to_messages(items: list[dict]) -> list[dict]:
    """Response items (input or stored output, as dicts) → chat messages. Consecutive function calls
    join the assistant message before them; a reasoning item goes with the next assistant turn."""
    out: list[dict] = []
    reasoning: str | None = None
    for it in items:
        kind = it.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(it) or reasoning
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append(_assistant(None, reasoning, [call]))
                reasoning = None
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": _text(it["output"])})
        elif it["role"] == "assistant":
            out.append(_assistant(_text(it["content"]), reasoning, None))
            reasoning = None
        else:
            out.append({"role": it["role"], "content": _text(it["content"])})
    return out


def _assistant(content: str | None, reasoning: str | None, calls: list[dict] | None) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def input_messages(r: ResponsesRequest) -> list[dict]:
    """This request's own input as chat messages (without the instructions)."""
    if isinstance(r.input, str):
        return [{"role": "user", "content": r.input}]
    return items_to_messages([it.model_dump(by_alias=True, exclude_none=True) for it in r.input])


def _tools(r: ResponsesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if r.tools:
        out["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                        for t in r.tools]
    if r.tool_choice is not None:
        tc = r.tool_choice
        out["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    if r.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = r.parallel_tool_calls
    return out


def _response_format(r: ResponsesRequest) -> dict[str, Any] | None:
    fmt = r.text.format if r.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    js: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        js["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": js}


def chat_body(r: ResponsesRequest, history: list[dict]) -> dict[str, Any]:
    """The chat-completions body for this request after `history` (a stored chain's messages)."""
    system = [{"role": "system", "content": r.instructions}] if r.instructions is not None else []
    body: dict[str, Any] = {"messages": system + history + input_messages(r), "stream": True, **_tools(r)}
    for k in ("model", "seed", "user", "temperature", "top_p"):
        v = getattr(r, k)
        if v is not None and k in r.model_fields_set:    # unset: the model's generation config may default it
            body[k] = v
    if r.max_output_tokens is not None:
        body["max_completion_tokens"] = r.max_output_tokens
    fmt = _response_format(r)
    if fmt is not None:
        body["response_format"] = fmt
    if r.reasoning is not None and r.reasoning.effort is not None:
        body["reasoning_effort"] = r.reasoning.effort
    return body


# chat field → the Responses field a 400 should name
PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def response_param(param: str | None) -> str | None:
    if param is None:
        return None
    base = param.partition(".")[0].split("[")[0]
    return PARAM_NAMES.get(base, param) if base in PARAM_NAMES else param


def response_message(message: str) -> str:
    """A chat error's text with the Responses field names."""
    for chat, resp in (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                       ("reasoning_effort", "reasoning.effort")):
        message = message.replace(chat, resp)
    return message
