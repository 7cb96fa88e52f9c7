"""The think-block parsers on scripted outputs: opened by the output or the template, closed by the
template, cut off, skipped; streamed in every split equals the whole text at once."""
from __future__ import annotations

import pytest

from chatserve.reasoning import choose_parser_name, parser_for, thinking_switch
from chatserve.reasoning.parser import prompt_opens_block

QWEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_OFF = QWEN_PROMPT + "<think>\n\n</think>\n\n"
OPENED = QWEN_PROMPT + "<think>\n"
R1_PROMPT = "<｜User｜>hi<｜Assistant｜>"


def whole(name: str, prompt: str, text: str) -> tuple[str, str]:
    p = parser_for(name, prompt)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return r1 + r2, c1 + c2


def streamed(name: str, prompt: str, pieces: list[str]) -> tuple[str, str]:
    p = parser_for(name, prompt)
    rs, cs = [], []
    for piece in pieces:
        r, c = p.feed(piece)
        rs.append(r)
        cs.append(c)
    r, c = p.finish()
    return "".join(rs) + r, "".join(cs) + c


CASES = [
    # (parser, prompt, output, reasoning, content)
    ("qwen3", QWEN_PROMPT, "<think>\nLet me see.\n2+2 is 4.\n</think>\n\nThe answer is 4.",
     "Let me see.\n2+2 is 4.", "The answer is 4."),
    ("qwen3", QWEN_PROMPT, "The answer is 4.", "", "The answer is 4."),          # skipped thinking
    ("qwen3", QWEN_PROMPT, "<think>\nstill thinking about", "still thinking about", ""),   # cut off
    ("qwen3", QWEN_PROMPT, "<thinking is fun>", "", "<thinking is fun>"),     # not the tag
    ("qwen3", QWEN_PROMPT, "<", "", "<"),
    ("qwen3", OPENED, "hmm\n</think>\n\nFour.", "hmm", "Four."),             # template-opened
    ("qwen3", OPENED, "<think>\nhmm</think>Four.", "hmm", "Four."),         # repeated start tag
    ("qwen3", OPENED, "hmm, cut", "hmm, cut", ""),
    ("qwen3", QWEN_OFF, "Four.", "", "Four."),                              # thinking switched off
    ("qwen3", QWEN_OFF, "<think>x</think>Four.", "", "<think>x</think>Four."),
    ("qwen3", QWEN_PROMPT, "<think></think>Four. a < b </think>", "", "Four. a < b </think>"),
    ("qwen3", QWEN_PROMPT, "<think>a < b </thin and </think> ok", "a < b </thin and", "ok"),
    ("deepseek_r1", R1_PROMPT, "Okay, so.\n</think>\n\nParis.", "Okay, so.", "Paris."),
    ("deepseek_r1", R1_PROMPT, "<think>\nOkay.\n</think>\nParis.", "Okay.", "Paris."),
    ("deepseek_r1", R1_PROMPT, "Okay, cut off here", "Okay, cut off here", ""),
    ("deepseek_r1", R1_PROMPT + "<think>\n", "Okay.</think>Paris.", "Okay.", "Paris."),
    ("deepseek_r1", R1_PROMPT + "<think>\n\n</think>\n\n", "Paris.", "", "Paris."),
    ("qwen3", QWEN_PROMPT, "", "", ""),
    ("deepseek_r1", R1_PROMPT, "", "", ""),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_whole_output(name, prompt, text, reasoning, content):
    assert whole(name, prompt, text) == (reasoning, content)


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_every_split_streams_the_same(name, prompt, text, reasoning, content):
    """Character by character, and cut at every point into two deltas."""
    assert streamed(name, prompt, list(text)) == (reasoning, content)
    for k in range(len(text) + 1):
        assert streamed(name, prompt, [text[:k], text[k:]]) == (reasoning, content), k


def test_reasoning_streams_before_the_end_tag():
    """Reasoning text is handed out as it comes (only a possible tag prefix and whitespace wait)."""
    p = parser_for("qwen3", QWEN_PROMPT)
    assert p.feed("<think>\nOne") == ("One", "")
    assert p.in_reasoning and p.thinking_started
    assert p.feed(" two </") == (" two", "")
    assert p.feed("think>\n\nAns") == ("", "Ans")
    assert not p.in_reasoning and p.reasoning_done
    assert p.feed("wer") == ("", "wer")
    assert p.finish() == ("", "")


def test_undecided_until_the_first_characters():
    p = parser_for("qwen3", QWEN_PROMPT)
    assert p.feed("\n<th") == ("", "")
    assert p.in_reasoning and not p.thinking_started
    assert p.feed("ey") == ("", "<they")
    assert p.reasoning_done


def test_prompt_state():
    assert prompt_opens_block(OPENED, "<think>", "</think>") is True
    assert prompt_opens_block(QWEN_OFF, "<think>", "</think>") is False
    assert prompt_opens_block(QWEN_PROMPT, "<think>", "</think>") is None
    # an earlier turn's closed block is not the generation prompt's
    hist = "<|im_start|>assistant\n<think>\nx\n</think>\n\nold<|im_end|>\n" + QWEN_PROMPT
    assert prompt_opens_block(hist, "<think>", "</think>") is None


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        parser_for("nope")


def test_choose_parser_name():
    assert choose_parser_name(None) is None
    assert choose_parser_name("{{ messages }}", "qwen3") is None        # Qwen3-Instruct-2507: no thinking
    assert choose_parser_name("{% if '</think>' in c %}{% endif %}<|im_start|>", "qwen3") == "qwen3"
    assert choose_parser_name("{{ '<｜Assistant｜>' }}{% if '</think>' in c %}{% endif %}") == "deepseek_r1"
    assert choose_parser_name("{% if '</think>' in c %}{% endif %}", "deepseek_v3") == "deepseek_r1"


def test_thinking_switch():
    t = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
    assert thinking_switch("none", t) == {"enable_thinking": False}
    assert thinking_switch("low", t) == {"enable_thinking": True}
    assert thinking_switch("high", t) == {"enable_thinking": True}
    assert thinking_switch(None, t) == {}
    assert thinking_switch("none", "{{ messages }}") == {}


def test_resolve_parser_name():
    from chatserve.reasoning import resolve_parser_name
    think = "{% if '</think>' in c %}{% endif %}"
    assert resolve_parser_name("auto", think) == "qwen3"
    assert resolve_parser_name("off", think) is None
    assert resolve_parser_name("deepseek_r1", "{{ messages }}") == "deepseek_r1"
