"""Chat templates: a conversation → prompt text, rendered by transformers' own template machinery (its
sandboxed jinja environment, reasoning-field aliases and `continue_final_message`), plus the checks
that turn bad messages into a ValueError fit for a 400. Not tokenization (tokenizer.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def load_chat_template(file_or_string: str) -> str:
    """--chat-template: a template file (.jinja, or a JSON holding "chat_template"), or the template
    text itself. A value that names no file and holds no jinja markup is an error, not a template."""
    path = Path(file_or_string).expanduser()
    is_markup = "{{" in file_or_string or "{%" in file_or_string
    if not is_markup and path.is_file():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            template = pick_template(json.loads(text).get("chat_template"))
            if template is None:
                raise ValueError(f"{file_or_string}: no \"chat_template\" in this JSON file")
            return template
        return text
    if not is_markup:
        raise ValueError(f"chat template {file_or_string!r} is neither a file nor a jinja template")
    return file_or_string


def pick_template(value: Any) -> str | None:
    """A template string, or the "default" entry of a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def render(template: str, messages: list[Mapping[str, Any]], *, add_generation_prompt: bool = True,
           tools: list[dict] | None = None, continue_final_message: bool = False,
           special_tokens: Mapping[str, str] | None = None, **template_kwargs: Any) -> str:
    """The prompt text, as transformers' `apply_chat_template(tokenize=False)` renders it.

    Raises ValueError when the messages hold non-JSON values or the template rejects them (e.g. roles that do
    not alternate, or a final message to continue that is not an assistant's)."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = template_messages(messages)
    if tools is not None:
        check_plain(tools, "tools")
    for k, v in template_kwargs.items():
        check_plain(v, k)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    context = {**(special_tokens or {}), **template_kwargs}
    try:
        tool_list: list[dict[str, Any] | Callable[..., Any]] | None = None if tools is None else list(tools)
        # transformers annotates `-> str`, but it returns (rendered text, generation indices)
        rendered, _ = render_jinja_template(  # type: ignore[str-unpack]  # see the line above
            conversations=[msgs], tools=tool_list, chat_template=template,
            continue_final_message=continue_final_message, add_generation_prompt=add_generation_prompt,
            **context)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e}") from None
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
        raise ValueError(f"the chat template could not render these messages: {e}") from None
    return rendered[0]


def import_renderer() -> None:
    """Import the renderer (transformers: ~2 s) now, off the path of a chat request: a server calls this in
    the background once it is ready, since a cached tokenizer no longer renders anything at load."""
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401


def check_plain(value: Any, where: str) -> None:
    """Template inputs must be plain JSON data (the template runs in a sandbox; objects do not go in)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: keys must be strings")
            check_plain(v, f"{where}.{k}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise ValueError(f"{where}: unsupported value of type {type(value).__name__}")


def template_messages(messages: list[Mapping[str, Any]]) -> list[dict]:
    """The messages as the template gets them: None-valued keys dropped (as transformers does), so an
    assistant message with `tool_calls` and null content, or a `tool` message, goes in as is; only plain
    JSON data (the sandbox rule). Their shape is the caller's to have checked: the server validates a
    request once (server/schemas), the sessions their stored turns."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role")
        m = {k: v for k, v in m.items() if v is not None}
        check_plain(m, f"messages[{i}]")
        out.append(m)
    return out
