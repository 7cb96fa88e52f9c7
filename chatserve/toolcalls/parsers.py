"""Tool-call formats models write, read from (possibly partial) output text.

Each parser turns the text generated so far into `Extraction`: the content that is certainly not part
of a call, and the calls seen so far (name once complete, the raw JSON text of the arguments as it
grows). Re-running a parser on a longer text only extends what it returned, so a stream can send the
difference. Not streaming (stream.py) and not prompting (prompt.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class PartialCall:
    name: str | None = None
    arguments: str = ""           # raw JSON text of the arguments value, as far as it is written
    arguments_done: bool = False
    done: bool = False            # the call object is closed


@dataclass
class Extraction:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


# ── a tolerant scanner for JSON that may stop anywhere ───────────────────────────────────────────
def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at s[i], or None if the text stops inside it."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 2
                    continue
                if ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None     # a literal is only known complete once something follows


def scan_call(s: str, i: int = 0) -> tuple[PartialCall | None, int]:
    """The call object starting at s[i] ('{'): its name and raw arguments so far, and where it ends."""
    i = _skip_ws(s, i)
    if i >= len(s) or s[i] != "{":
        return None, i
    call = PartialCall()
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return call, i
        if s[i] == "}":
            call.done = True
            return call, i + 1
        kend = value_end(s, i)
        if s[i] != '"' or kend is None:
            return call, len(s)
        key = json.loads(s[i:kend])
        i = _skip_ws(s, kend)
        if i >= len(s) or s[i] != ":":
            return call, len(s)
        vs = _skip_ws(s, i + 1)
        ve = value_end(s, vs)
        if key == "name" and ve is not None and s[vs] == '"':
            call.name = json.loads(s[vs:ve])
        elif key in ARGUMENT_KEYS and vs < len(s):
            if s[vs] == '"':          # arguments sent as a JSON string: only once it is complete
                if ve is not None:
                    call.arguments, call.arguments_done = json.loads(s[vs:ve]), True
            else:
                call.arguments = s[vs:ve if ve is not None else len(s)].rstrip()
                call.arguments_done = ve is not None
        if ve is None:
            return call, len(s)
        i = _skip_ws(s, ve)
        if i < len(s) and s[i] == ",":
            i += 1


def scan_call_array(s: str, i: int = 0) -> list[PartialCall]:
    """Calls of a JSON array of call objects starting at s[i] ('[')."""
    i = _skip_ws(s, i)
    calls: list[PartialCall] = []
    if i >= len(s) or s[i] != "[":
        return calls
    i += 1
    while True:
        call, i = scan_call(s, i)
        if call is None:
            return calls
        calls.append(call)
        if not call.done:
            return calls
        i = _skip_ws(s, i)
        if i < len(s) and s[i] == ",":
            i += 1
        else:
            return calls


def _held_back(text: str, marker: str) -> str:
    """`text` minus a tail that could be the start of `marker` (not yet known to be content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


# ── the formats ──────────────────────────────────────────────────────────────────────────────────
class ToolCallParser:
    name = ""
    whole_calls = False          # True: a call is sent only once its arguments are complete

    def extract(self, text: str, final: bool) -> Extraction:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """Hermes / Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, any number, after content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def extract(self, text: str, final: bool) -> Extraction:
        at = text.find(self.OPEN)
        if at < 0:
            return Extraction(content=text if final else _held_back(text, self.OPEN))
        out = Extraction(content=text[:at].rstrip())
        while at >= 0:
            body_start = at + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            call, _ = scan_call(body)
            if call is not None:
                out.calls.append(call)
            if end < 0:
                break
            at = text.find(self.OPEN, end)
        return out


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the whole reply is `{"name": …, "parameters": {…}}` (optionally after <|python_tag|>),
    several separated by `;`. A reply that does not start with `{` is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str, final: bool) -> Extraction:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        elif not final and body and self.TAG.startswith(body):
            return Extraction()            # maybe the tag, maybe text: not known yet
        if not body:
            return Extraction(content=text if final else "")
        if not body.startswith("{"):
            return Extraction(content=text)
        out = Extraction()
        i = 0
        while True:
            call, i = scan_call(body, i)
            if call is None:
                break
            out.calls.append(call)
            i = _skip_ws(body, i)
            if not call.done or i >= len(body) or body[i] != ";":
                break
            i += 1
        return out


class MistralParser(ToolCallParser):
    """Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (the marker may be a skipped special
    token, so a reply that starts with `[{` is read as calls too)."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def extract(self, text: str, final: bool) -> Extraction:
        at = text.find(self.MARK)
        if at >= 0:
            return Extraction(content=text[:at].rstrip(), calls=scan_call_array(text, at + len(self.MARK)))
        body = text.lstrip()
        if body.startswith("[{") or (not final and body in ("", "[")):
            return Extraction(calls=scan_call_array(body)) if body.startswith("[{") else Extraction()
        return Extraction(content=text if final else _held_back(text, self.MARK))


class ForcedArrayParser(ToolCallParser):
    """Output forced by the grammar for tool_choice "required": `[{"name": …, "arguments": {…}}, …]`."""

    name = "forced"
    whole_calls = True           # the grammar makes complete arguments valid; cut-off ones never go out

    def extract(self, text: str, final: bool) -> Extraction:
        return Extraction(calls=scan_call_array(text))


class ForcedNamedParser(ToolCallParser):
    """Output forced by the grammar for a named tool_choice: the arguments object itself."""

    name = "forced_named"
    whole_calls = True

    def __init__(self, function: str) -> None:
        self.function = function

    def extract(self, text: str, final: bool) -> Extraction:
        body = text.lstrip()
        if not body:
            return Extraction()
        end = value_end(body, 0)
        return Extraction(calls=[PartialCall(self.function, body[:end] if end else body.rstrip(),
                                             end is not None, end is not None)])


class GptOssParser(ToolCallParser):
    """gpt-oss (harmony): a message to `functions.NAME` whose body is the arguments, ended by `<|call|>`:
    `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{…}<|call|>` (the recipient
    may also follow the channel). Content is what stands before the call's header; the harmony reasoning
    parser has already taken the channels' framing off it (chatserve/reasoning/harmony.py)."""

    name = "gpt_oss"
    MARK, MESSAGE, CALL = "to=functions.", "<|message|>", "<|call|>"
    _HEADER_STARTS = ("<|start|>", "<|channel|>")
    _ENDS = ("<|end|>", "<|return|>", "<|call|>")

    def extract(self, text: str, final: bool) -> Extraction:
        at = text.find(self.MARK)
        if at < 0:
            if final:
                return Extraction(content=text)
            head = self._before_header(text)          # a call's header may be on its way
            return Extraction(content=_held_back(_held_back(head, self.MARK), "<|start|>"))
        out = Extraction(content=self._before_header(text[:at]).rstrip())
        while at >= 0:
            rest = text[at + len(self.MARK):]
            name_end = min((k for k in (rest.find(" "), rest.find("<|")) if k >= 0), default=-1)
            body_at = rest.find(self.MESSAGE)
            if name_end < 0 or body_at < 0:
                out.calls.append(PartialCall(name=rest[:name_end] if name_end >= 0 else None))
                break
            body_start = at + len(self.MARK) + body_at + len(self.MESSAGE)
            end = text.find(self.CALL, body_start)
            closed = end >= 0 or final
            args = text[body_start:end] if end >= 0 else text[body_start:]
            out.calls.append(PartialCall(rest[:name_end], (args if closed else _held_back(args, self.CALL)).strip(),
                                         closed, closed))
            at = -1 if end < 0 else text.find(self.MARK, end)
        return out

    def _before_header(self, head: str) -> str:
        """`head` less a call header's opening (`<|start|>assistant`, `<|channel|>commentary`)."""
        cut = max(head.rfind(h) for h in self._HEADER_STARTS)
        if cut >= 0 and cut >= max(head.rfind(e) for e in self._ENDS):
            return head[:cut]
        return head


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                                GptOssParser)}


def default_parser_name(chat_template: str | None) -> str:
    """The parser a chat template implies: gpt-oss's harmony calls, Mistral's marker, Llama 3's python
    tag, else Hermes."""
    t = chat_template or ""
    if "<|channel|>" in t and "to=" in t and "<|call|>" in t:
        return "gpt_oss"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"
