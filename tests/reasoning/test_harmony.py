"""gpt-oss's harmony output read by the harmony reasoning parser and the gpt_oss tool-call parser, whole and
split at every point; the stop tokens of a harmony vocabulary; history calls rendered through the real
gpt-oss template the way transformers renders them (arguments as an object, not quoted twice)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatserve.reasoning import choose_parser_name, parser_for, thinking_switch
from chatserve.toolcalls.parsers import GptOssParser, default_parser_name
from chatserve.toolcalls.prompt import with_object_arguments

TEMPLATE = (Path(__file__).parent / "templates" / "gpt_oss.jinja").read_text()
CALL_OUT = "<|start|>assistant to=functions.now<|channel|>commentary<|message|>{\"tz\": \"UTC\"}<|call|>"
CASES = [   # (model output after the prompt's `<|start|>assistant`, reasoning, content)
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
     "Think.", "Hi!"),
    ("<|channel|>final<|message|>Only the answer.<|return|>", "", "Only the answer."),
    ("<|channel|>analysis<|message|>cut off by max_tok", "cut off by max_tok", ""),
    ("No channels at all.", "", "No channels at all."),
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>B.<|return|>", "A.", "Checking.B."),
    ("<|channel|>analysis<|message|>Time?<|end|><|start|>assistant to=functions.now<|channel|>commentary "
     "<|constrain|>json<|message|>{\"tz\": \"UTC\"}<|call|>", "Time?", CALL_OUT),
    ("<|channel|>analysis<|message|>Time?<|end|><|start|>assistant<|channel|>commentary to=functions.now "
     "<|constrain|>json<|message|>{\"tz\": \"UTC\"}<|call|>", "Time?", CALL_OUT),
    ("<|channel|>analysis<|message|>Look up.<|end|><|start|>assistant<|channel|>analysis to=browser.search "
     "code<|message|>{\"query\": \"x\"}<|call|>", "Look up.{\"query\": \"x\"}", ""),
]


def _run(text: str, cuts: list[int]) -> tuple[str, str]:
    p = parser_for("harmony")
    r, c, last = "", "", 0
    for k in [*cuts, len(text)]:
        a, b = p.feed(text[last:k])
        r, c, last = r + a, c + b, k
    a, b = p.finish()
    return r + a, c + b


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_whole_and_every_split(text, reasoning, content):
    assert _run(text, []) == (reasoning, content)
    for k in range(1, len(text)):
        assert _run(text, [k]) == (reasoning, content), k
    assert _run(text, list(range(1, len(text)))) == (reasoning, content)


def test_phases():
    p = parser_for("harmony")
    assert p.phase == "undecided" and p.in_reasoning
    p.feed("<|channel|>analysis<|message|>Hm")
    assert p.phase == "reasoning" and p.thinking_started and p.in_reasoning
    p.feed("<|end|><|start|>assistant<|channel|>final<|message|>A")
    assert p.phase == "content" and not p.in_reasoning


@pytest.mark.parametrize("cut", range(0, len(CALL_OUT) + 1, 7))
def test_gpt_oss_tool_parser_grows_monotonically(cut):
    """A prefix of the call never yields content, and its arguments are a prefix of the final ones."""
    part = GptOssParser().extract("Let me check." + CALL_OUT[:cut], final=False)
    assert part.content in ("", "Let me check.")
    whole = GptOssParser().extract("Let me check." + CALL_OUT, final=True)
    assert whole.content == "Let me check."
    assert [(c.name, json.loads(c.arguments), c.done) for c in whole.calls] == [("now", {"tz": "UTC"}, True)]
    for c in part.calls:
        assert c.name in (None, "now") and whole.calls[0].arguments.startswith(c.arguments)


def test_chosen_for_gpt_oss():
    assert choose_parser_name(TEMPLATE) == "harmony"
    assert choose_parser_name(None, "/models/gpt-oss-20b-Q4_K_M.gguf") == "harmony"
    assert default_parser_name(TEMPLATE) == "gpt_oss"
    assert thinking_switch("high", TEMPLATE) == {"reasoning_effort": "high"}
    assert thinking_switch("none", TEMPLATE) == {"reasoning_effort": "low"}


def test_history_calls_render_as_transformers_does():
    """A tool-call turn sent the OpenAI way (arguments as JSON text) renders through the gpt-oss template as
    transformers renders the arguments object it documents: `<|message|>{"tz": "UTC"}<|call|>`."""
    from transformers.utils.chat_template_utils import render_jinja_template
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}
    openai_shape = [{"role": "user", "content": "time?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    as_object = json.loads(json.dumps(openai_shape))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"tz": "UTC"}
    ours = render_jinja_template([with_object_arguments(openai_shape, TEMPLATE)], chat_template=TEMPLATE,
                                 add_generation_prompt=True)[0][0]
    reference = render_jinja_template([as_object], chat_template=TEMPLATE, add_generation_prompt=True)[0][0]
    assert ours == reference
    assert 'json<|message|>{"tz": "UTC"}<|call|>' in ours
    assert openai_shape[1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'     # not mutated


def test_harmony_stop_tokens(tmp_path):
    """`<|end|>` closes one message of a gpt-oss reply, so it is no stop token; `<|return|>` and `<|call|>`
    are. (Phi-3's `<|end|>`, in a vocabulary without harmony's markers, still stops.)"""
    import think_models
    from chatserve.text.tokenizer import Tokenizer
    from tokenizers import Tokenizer as Backend
    think_models._tokenizer(tmp_path, [], think_models.HARMONY_SPECIAL)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(backend, chat_template=TEMPLATE, special_tokens={"eos_token": "<|return|>"})
    ids = {backend.token_to_id(t) for t in ("<|return|>", "<|call|>")}
    assert ids <= tok.eos_token_ids and backend.token_to_id("<|end|>") not in tok.eos_token_ids
    phi = tmp_path / "phi"
    phi.mkdir()
    think_models._tokenizer(phi, [], ["<|end|>", "<|user|>", "<|assistant|>"])
    backend = Backend.from_file(str(phi / "tokenizer.json"))
    assert backend.token_to_id("<|end|>") in Tokenizer(backend).eos_token_ids
