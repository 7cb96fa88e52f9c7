"""What users may set on a session, checked with the OpenAI routes' own rules (protocol.py):
settings, sampling parameters, turn requests and imported documents. 400s in the OpenAI shape.

Not body reading (body.py) and not storage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from chatserve.server.errors import APIError, invalid
from chatserve.server.protocol import sampling_params, validate
from chatserve.server.schemas.openai import SamplingFields
from chatserve.server.schemas.sessions import TurnRequest as TurnBody
from chatserve.server.sessions.session import ROOT, Session

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "stop")
PARAM_KEYS = SAMPLING_KEYS + ("reasoning_effort",)     # a session's params: sampling + the thinking switch
REASONING_EFFORTS = ("none", "low", "medium", "high")
USAGE_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "tokens_per_s", "queue_s",
              "reasoning_tokens", "reasoning_s")
MAX_CONTENT_CHARS = 200_000
MAX_TITLE_CHARS = 200
MAX_IMPORT_MESSAGES = 5_000
MAX_ID_CHARS = 64
ROLES = ("user", "assistant", "system")
FINISH_REASONS = ("stop", "length", "abort", "error", "interrupted", "content_filter")


def clean_params(raw: Any, state: Any, param: str = "params") -> dict[str, Any]:
    """Sampling defaults and the thinking switch: only the known keys, each valid by the OpenAI routes'
    rules (protocol.py)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid(f"'{param}' must be an object", param, "invalid_type")
    for k in raw:
        if k not in PARAM_KEYS:
            raise invalid(f"unknown sampling parameter {k[:40]!r}", param)
    out = {k: v for k, v in raw.items() if v is not None}
    if out.get("reasoning_effort", "none") not in REASONING_EFFORTS:
        raise invalid(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    sampling = {k: v for k, v in out.items() if k in SAMPLING_KEYS}
    fields = validate(SamplingFields, sampling)                  # the routes' own 400s
    served = state.models.peek(None)
    if served is not None:                                       # and the default model's (vocabulary, EOS)
        sampling_params(fields, served, n=1, logprobs=None)
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def clean_text(v: Any, name: str, limit: int) -> str:
    if not isinstance(v, str):
        raise invalid(f"'{name}' must be a string", name, "invalid_type")
    if len(v) > limit:
        raise invalid(f"'{name}' is longer than {limit} characters", name)
    return v


def clean_id(v: Any, name: str) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
        raise invalid(f"'{name}' must be a message id", name, "invalid_type")
    return v


def apply_settings(s: Session, body: dict[str, Any], state: Any) -> None:
    """Set title, system_prompt, params, model from a create/PATCH/import body (all validated; a model this
    server does not serve is a 404)."""
    if "title" in body:
        s.title = clean_text(body["title"], "title", MAX_TITLE_CHARS).strip() or "New chat"
    if "system_prompt" in body:
        s.system_prompt = clean_text(body["system_prompt"] or "", "system_prompt", MAX_CONTENT_CHARS)
    if "params" in body:
        s.params = clean_params(body["params"], state)
    if "model" in body:
        s.model = None if body["model"] is None else served_model_name(clean_text(body["model"], "model", 200),
                                                                      state)


def served_model_name(name: str, state: Any) -> str:
    """`name` when this server serves a model by it (any of its names), else a 404 listing the served
    names, at once: not at the session's next turn."""
    state.models.resolve(name)
    return name


def clean_message(m: Any, param: str) -> dict[str, Any]:
    """One imported message: role, content, created, and for replies usage and finish_reason."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise invalid("each message needs a role: user, assistant or system", param)
    created = m.get("created")
    msg: dict[str, Any] = {
        "role": m["role"], "content": clean_text(m.get("content", ""), f"{param}.content", MAX_CONTENT_CHARS),
        "created": float(created) if isinstance(created, (int, float)) and not isinstance(created, bool)
        and 0 <= created < 1e11 else time.time()}
    if m["role"] == "assistant" and isinstance(m.get("usage"), dict):
        msg["usage"] = {k: v for k, v in m["usage"].items()
                        if k in USAGE_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if m["role"] == "assistant" and m.get("reasoning_content"):
        msg["reasoning_content"] = clean_text(m["reasoning_content"], f"{param}.reasoning_content",
                                              MAX_CONTENT_CHARS)
    if m.get("finish_reason") in FINISH_REASONS:
        msg["finish_reason"] = m["finish_reason"]
    if isinstance(m.get("error"), str):
        msg["error"] = m["error"][:500]
    return msg


def import_messages(s: Session, body: dict[str, Any]) -> None:
    """An export document's messages into `s`: v2's `tree` (every version) when present, else v1's
    flat `messages` as one branch. Ids are new; the structure and the active branch are kept."""
    tree = body.get("tree")
    if tree is None:
        raw = body.get("messages", [])
        if not isinstance(raw, list) or len(raw) > MAX_IMPORT_MESSAGES:
            raise invalid(f"'messages' must be a list of at most {MAX_IMPORT_MESSAGES}", "messages")
        for i, m in enumerate(raw):
            s.add_message(clean_message(m, f"messages[{i}]"))
        return
    if not isinstance(tree, dict) or not isinstance(tree.get("nodes"), list):
        raise invalid("'tree' must be {\"nodes\": [...], \"active\": id}", "tree", "invalid_type")
    nodes = tree["nodes"]
    if len(nodes) > MAX_IMPORT_MESSAGES:
        raise invalid(f"'tree.nodes' holds at most {MAX_IMPORT_MESSAGES} messages", "tree")
    new_id: dict[str, str] = {}
    for i, n in enumerate(nodes):
        p = f"tree.nodes[{i}]"
        if not isinstance(n, dict):
            raise invalid(f"{p} must be an object", p, "invalid_type")
        old = clean_id(n.get("id"), f"{p}.id")
        parent = n.get("parent")
        if parent in (None, ROOT):
            parent_new = ROOT
        elif isinstance(parent, str) and parent in new_id:
            parent_new = new_id[parent]
        else:
            raise invalid(f"{p}.parent must be the id of an earlier message", f"{p}.parent")
        if old in new_id:
            raise invalid(f"{p}.id is not unique", f"{p}.id")
        new_id[old] = s.add_message(clean_message(n, p), parent=parent_new)["id"]
    active = tree.get("active")
    if active is not None:
        if not isinstance(active, str) or active not in new_id:
            raise invalid("'tree.active' must be the id of one of the messages", "tree.active")
        s.select(new_id[active])


@dataclass
class TurnRequest:
    """A validated turn body: what to add, where, and the per-turn sampling overrides."""

    content: str | None
    replace_from: int | None
    edit_id: str | None
    regenerate: bool
    overrides: dict[str, Any]
    stream: bool


def parse_turn(body: dict[str, Any], state: Any) -> TurnRequest:
    """A turn body (HTTP, or the WebSocket `session` message with its session_id), validated by the
    schema /openapi.json publishes (schemas/sessions.TurnRequest)."""
    t = validate(TurnBody, {k: v for k, v in body.items() if k != "session_id"})
    content, replace_from, regenerate = t.content, t.replace_from, bool(t.regenerate)
    edit_id = None if t.edit_id is None else clean_id(t.edit_id, "edit_id")
    if replace_from is not None and edit_id is not None:
        raise invalid("send 'replace_from' or 'edit_id', not both", "edit_id")
    overrides = clean_params({k: v for k, v in body.items() if k in PARAM_KEYS}, state, "params")
    if content is None and not regenerate and replace_from is None and edit_id is None:
        raise APIError(400, "'content' is required", param="content", code="missing_required_parameter")
    return TurnRequest(content, replace_from, edit_id, regenerate, overrides, t.stream)
