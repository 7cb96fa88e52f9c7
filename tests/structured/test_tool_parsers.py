"""Tool-call parsers and the streamed delta assembly, fed the formats models write, cut at every character."""
from __future__ import annotations

import json

import pytest

from chatserve.toolcalls.parsers import (ForcedArrayParser, ForcedNamedParser, HermesParser, Llama3JsonParser,
                                     MistralParser, default_parser_name)
from chatserve.toolcalls.stream import ToolCallFolder, ToolCallStream

ARGS = {"city": "Paris, \"FR\"", "days": 3, "units": ["c", "f"], "extra": {"deep": [1, {"x": None}]}}

CASES = [
    (HermesParser(), "Let me check.\n<tool_call>\n" + json.dumps({"name": "weather", "arguments": ARGS})
     + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "time", "arguments": {}}) + "\n</tool_call>",
     "Let me check.", [("weather", ARGS), ("time", {})]),
    (Llama3JsonParser(), "<|python_tag|>" + json.dumps({"name": "weather", "parameters": ARGS}) + "; "
     + json.dumps({"name": "time", "parameters": {}}), "", [("weather", ARGS), ("time", {})]),
    (MistralParser(), "[TOOL_CALLS]" + json.dumps([{"name": "weather", "arguments": ARGS}]), "",
     [("weather", ARGS)]),
    (MistralParser(), " " + json.dumps([{"name": "weather", "arguments": ARGS}]), "", [("weather", ARGS)]),
    (ForcedArrayParser(), json.dumps([{"name": "weather", "arguments": ARGS}, {"name": "time", "arguments": {}}],
                                     separators=(",", ":")), "", [("weather", ARGS), ("time", {})]),
    (ForcedNamedParser("weather"), json.dumps(ARGS), "", [("weather", ARGS)]),
    (HermesParser(), "Just text with a < sign and <tool no call.", "Just text with a < sign and <tool no call.", []),
    (Llama3JsonParser(), "The answer is 4.", "The answer is 4.", []),
]


def _stream(parser, text: str, step: int) -> tuple[str, list[dict], str | None]:
    s = ToolCallStream(parser)
    folder = ToolCallFolder(1)
    content = ""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta = s.push(piece, final=k == len(pieces) - 1)
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["function"]["name"] and tc["type"] == "function"
        content += folder.content({"index": 0, "delta": delta})
    msg = folder.message(0, content)
    return content, msg.get("tool_calls") or [], s.finish_reason("stop")


@pytest.mark.parametrize("parser,text,content,calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_calls_reassemble(parser, text, content, calls, step):
    got_content, got_calls, reason = _stream(parser, text, step)
    assert got_content.strip() == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(calls)
    assert reason == ("tool_calls" if calls else "stop")


def test_partial_tag_is_held_back_until_known():
    s = ToolCallStream(HermesParser())
    assert s.push("Hello <tool") == {"content": "Hello "}
    delta = s.push("_call>{\"name\": \"f\", \"arguments\": {\"a\"")
    call = delta["tool_calls"][0]
    assert "content" not in delta and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"a"'}


def test_default_parser_from_template():
    assert default_parser_name("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert default_parser_name("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_parser_name("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert default_parser_name(None) == "hermes"
