"""How tools and tool-call history reach a model: its own chat template when that knows tools, else a
documented fallback (docs/api.md): a system-prompt section listing the tools in the Hermes format, and
history rewritten to plain text (calls as `<tool_call>` blocks, results as `<tool_response>` user turns).
Not output parsing (parsers.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

FALLBACK_HEADER = ("You can call functions. The available functions, as JSON Schema, are:\n"
                   "<tools>\n{tools}\n</tools>\n"
                   "To call a function, reply with one block per call and nothing else:\n"
                   "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n</tool_call>")


def template_knows_tools(chat_template: str | None) -> bool:
    """True when the Jinja template reads the `tools` variable and renders `tool_calls` itself."""
    t = chat_template or ""
    return bool(re.search(r"\btools\b", t)) and "tool_calls" in t


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages a tool-unaware template can render: tools in the system prompt, calls and results as text."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps(_call_body(c), ensure_ascii=False)}\n</tool_call>"
                      for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        section = FALLBACK_HEADER.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False)
                                                         for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_body(call: dict) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"name": fn.get("name"), "arguments": args}


def template_wants_object_arguments(chat_template: str | None) -> bool:
    """The template writes a call's arguments with `tojson` and never checks for a string (gpt-oss,
    Llama 3.1, Mistral): given the OpenAI-shaped JSON text it would quote that text a second time."""
    t = re.sub(r"\s+", "", chat_template or "")
    return "arguments|tojson" in t and "argumentsisstring" not in t


def with_object_arguments(messages: list[dict], chat_template: str | None) -> list[dict]:
    """`messages` with each history call's arguments parsed into the JSON object a template like that
    expects (copies; arguments that are not a JSON object stay text); unchanged for other templates."""
    if not template_wants_object_arguments(chat_template):
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_with_object(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _with_object(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": parsed}} if isinstance(parsed, dict) else call
