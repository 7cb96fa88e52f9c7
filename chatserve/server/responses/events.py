"""Chat chunks (chatserve.server.chat_service) → the Responses API's output items and typed stream events.

`ResponseBuilder` turns one choice's chunks into reasoning, message and function_call items, with the
events that announce them (response.output_item.added, response.reasoning_text.delta,
response.output_text.delta, response.function_call_arguments.delta, … response.completed), each with a
sequence_number; a non-streamed response is the same builder with its events dropped. Not the HTTP
layer (routes.py) nor storage (store.py).
"""
from __future__ import annotations

import uuid
from typing import Any

Event = dict[str, Any]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(u: dict | None) -> dict | None:
    """Chat usage → Responses usage."""
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens":
                                      (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
            "total_tokens": u["total_tokens"]}


class ResponseBuilder:
    """One response: its items as they grow, and the events that tell a streaming client."""

    def __init__(self, rid: str, created_at: int, echo: dict[str, Any]) -> None:
        self.rid, self.created_at, self.echo = rid, created_at, echo
        self.output: list[dict] = []
        self.seq = 0
        self._open: dict | None = None           # the item being written
        self._calls: dict[int, dict] = {}        # chat tool-call index → its function_call item
        self.usage: dict | None = None
        self.finish: str | None = None
        self.error: dict | None = None

    def event(self, kind: str, **fields: Any) -> Event:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish == "length" else "completed"

    def response(self) -> dict:
        status = self.status
        return {"id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
                "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.echo, "output": [dict(it) for it in self.output], "usage": response_usage(self.usage)}

    def start(self) -> list[Event]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    # ── chunks in, events out ──────────────────────────────────────────────────────────────────
    def push(self, chunk: dict) -> list[Event]:
        if "error" in chunk:
            err = chunk["error"]
            self.error = {"code": err.get("code") or "server_error", "message": err.get("message", "")}
            return [*self._close(), self.event("error", code=self.error["code"], message=self.error["message"],
                                               param=err.get("param"))]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[Event] = []
        for ch in chunk.get("choices") or ():
            delta = ch.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for tc in delta.get("tool_calls") or ():
                events += self._call(tc)
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
        return events

    def finish_events(self) -> list[Event]:
        """The open item closed, then response.completed, its status "incomplete" at max_output_tokens
        (as vLLM: the SDKs' stream helpers take the final response from response.completed only)."""
        if self.error is not None:
            return []
        events = self._close()
        self.finish = self.finish or "stop"
        return [*events, self.event("response.completed", response=self.response())]

    # ── items ──────────────────────────────────────────────────────────────────────────────────
    def _add(self, item: dict) -> list[Event]:
        self.output.append(item)
        self._open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": []}
            events += self._add(item)
            item["content"] = [part]
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=dict(part)))
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=item["id"], output_index=len(self.output) - 1, content_index=0,
                                 delta=text, **extra))
        return events

    def _call(self, tc: dict) -> list[Event]:
        events: list[Event] = []
        fn = tc.get("function") or {}
        if tc["index"] not in self._calls:
            events += self._close()
            item = {"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": tc.get("id") or new_item_id("call"), "name": fn.get("name") or "", "arguments": ""}
            self._calls[tc["index"]] = item
            events += self._add(item)
        item = self._calls[tc["index"]]
        frag = fn.get("arguments") or ""
        if frag:
            item["arguments"] += frag
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=frag))
        return events

    def _close(self) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        k = self.output.index(item)
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self.event(done, item_id=item["id"], output_index=k, content_index=0, text=part["text"],
                                     **extra))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=k,
                                     content_index=0, part=dict(part)))
        if "status" in item:
            item["status"] = "completed"
        return [*events, self.event("response.output_item.done", output_index=k, item=dict(item))]
