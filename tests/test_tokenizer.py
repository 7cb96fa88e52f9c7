"""Tokenizer: loading (GGUF, HF dir, cache), encode/decode, chat templates against transformers."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from chatserve.config import default_model_path
from chatserve.text import Tokenizer

MODEL = default_model_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason="default model not installed")

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "Unicode: naïve café, 你好世界, こんにちは, 🎉🚀👩‍👩‍👧, Ελληνικά, עברית",
    "def f(x):\n    return x ** 2  # code\n",
    "Special text inline: <|im_start|>user hi<|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 🎉"},
    ],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight—\na worm digs silently\ninto the chestnut."},
        {"role": "user", "content": "Another, with\nnewlines\n\n and  spaces "},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model(MODEL)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(MODEL), gguf_file=os.path.basename(MODEL))


def test_metadata(tok):
    assert tok.vocab_size == 49152
    im_end, eot = tok.encode("<|im_end|>"), tok.encode("<|endoftext|>")
    assert len(im_end) == 1 and len(eot) == 1
    assert tok.end_of_turn_id == im_end[0]
    assert tok.eos_token_ids == frozenset({im_end[0], eot[0]})
    assert tok.bos_token_id == tok.encode("<|im_start|>")[0]
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == text                     # round trip
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()               # exact bytes per token


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf, conv, gen):
    msgs = CONVERSATIONS[conv]
    assert tok.render_chat(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
        msgs, add_generation_prompt=gen, tokenize=False)
    want = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == list(want)


# Templates that exercise the jinja environment: loop controls, namespace, tojson, raise_exception,
# {% generation %}, special-token variables, tools and extra keyword arguments.
TEMPLATES = {
    "llama3ish": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system must come first') }}{% endif %}"
        "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "namespace_tojson": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}"
        "{% set ns.n = ns.n + 1 %}{% endif %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
        "[{{ ns.n }}]{{ m | tojson }}\n{% endfor %}{% if tools %}TOOLS={{ tools | tojson(indent=2) }}{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}{{ eos_token }}"
    ),
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
        "{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}\n{% endfor %}"
        "{% if messages[-1].reasoning_content is defined %}R={{ messages[-1].reasoning_content }}{% endif %}"
    ),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_custom_templates_match_transformers(tok, hf, name):
    t = tok.with_chat_template(TEMPLATES[name])
    msgs = [
        {"role": "system", "content": "  sys  "},
        {"role": "user", "content": "héllo \"quoted\" <b>"},
        {"role": "tool", "content": "42", "name": None},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "user", "content": "next"},
    ]
    for kwargs in ({}, {"tools": TOOLS, "enable_thinking": False}):
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, chat_template=TEMPLATES[name], add_generation_prompt=gen,
                                          tokenize=False, **kwargs)
            assert t.render_chat(msgs, add_generation_prompt=gen, **kwargs) == want


def test_bad_messages_raise_value_error(tok):
    # the message shapes are the request schema's to check (validated once); the text layer still refuses
    # what is not a list of role-carrying objects of plain JSON data (the sandbox rule)
    for bad in ([], "hello", [1], [{"content": "no role"}], [{"role": "user", "content": object()}]):
        with pytest.raises(ValueError):
            tok.apply_chat_template(bad)
    strict = tok.with_chat_template(TEMPLATES["llama3ish"])
    with pytest.raises(ValueError, match="system must come first"):
        strict.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="has no chat template"):
        tok.with_chat_template(None).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="does not parse"):
        tok.with_chat_template("{% for %}").render_chat([{"role": "user", "content": "hi"}])
    escape = tok.with_chat_template("{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(ValueError):
        escape.render_chat([{"role": "user", "content": "hi"}])
    sandbox = tok.with_chat_template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        sandbox.render_chat([{"role": "user", "content": "hi"}])


def test_cold_then_warm_load(tmp_path):
    from chatserve.text import tokenizer as mod

    mod._memo.clear()  # not the fixture's instance: build from the GGUF into an empty cache
    t0 = time.perf_counter()
    cold = Tokenizer.from_model(MODEL, cache_dir=tmp_path, use_cache=True)
    cold_s = time.perf_counter() - t0
    assert sorted(p.name.split(".", 1)[1] for p in tmp_path.iterdir()) == ["meta.json", "tokenizer.json"]
    mod._memo.clear()  # force the disk path
    t0 = time.perf_counter()
    warm = Tokenizer.from_model(MODEL, cache_dir=tmp_path)
    warm_s = time.perf_counter() - t0
    print(f"tokenizer cold {cold_s:.2f} s, warm {warm_s:.2f} s")
    assert warm_s < cold_s / 2, (cold_s, warm_s)          # the cache skips the GGUF parse
    assert warm is not cold and Tokenizer.from_model(MODEL, cache_dir=tmp_path) is warm  # memoized
    conv = CONVERSATIONS[2]
    assert warm.apply_chat_template(conv) == cold.apply_chat_template(conv)
    assert warm.eos_token_ids == cold.eos_token_ids and warm.chat_template == cold.chat_template
    print(f"tokenizer load: cold {cold_s:.2f}s, warm {warm_s:.2f}s")


def test_end_of_turn_probe_is_kept_in_the_disk_cache(tmp_path, monkeypatch):
    """The probe renders the template (importing transformers: seconds of a server start) once per cached
    tokenizer; a warm load reads its answer, a template override probes its own template."""
    from chatserve.text import chat_template as renderer
    from chatserve.text import tokenizer as mod

    mod._memo.clear()
    cold = Tokenizer.from_model(MODEL, cache_dir=tmp_path)
    im_end = cold.encode("<|im_end|>")
    assert cold.end_of_turn_id == im_end[0] and cold.end_of_turn_probe == im_end
    (meta,) = tmp_path.glob("*.meta.json")
    assert json.loads(meta.read_text())["end_of_turn_probe"] == im_end
    mod._memo.clear()
    rendered: list[str] = []
    real = renderer.render
    monkeypatch.setattr(renderer, "render", lambda t, *a, **k: rendered.append(t) or real(t, *a, **k))
    warm = Tokenizer.from_model(MODEL, cache_dir=tmp_path)
    assert rendered == [] and warm.end_of_turn_id == cold.end_of_turn_id
    assert warm.eos_token_ids == cold.eos_token_ids
    other = warm.with_chat_template("{% for m in messages %}{{ m.content }}<|endoftext|>{% endfor %}")
    assert len(rendered) == 1 and other.end_of_turn_id == warm.encode("<|endoftext|>")[0]
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "end_of_turn_probe": ["x"]}))   # damaged
    mod._memo.clear()
    again = Tokenizer.from_model(MODEL, cache_dir=tmp_path)
    assert len(rendered) == 2 and again.end_of_turn_id == cold.end_of_turn_id
    assert json.loads(meta.read_text())["end_of_turn_probe"] == im_end                  # repaired
    mod._memo.clear()


def test_hf_directory(tok, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    t = Tokenizer.from_model(str(tmp_path), use_cache=False)
    assert t.chat_template == tok.chat_template
    for text in TEXTS:
        assert t.encode(text) == tok.encode(text)
    for conv in CONVERSATIONS:
        assert t.apply_chat_template(conv) == tok.apply_chat_template(conv)
    assert t.eos_token_ids == tok.eos_token_ids | {7}                                # generation_config adds
    # a template kept in tokenizer_config.json instead of chat_template.jinja
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": TEMPLATES["llama3ish"]},
                            {"name": "tool_use", "template": "x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t2 = Tokenizer.from_model(str(tmp_path), use_cache=False)
    assert t2.chat_template == TEMPLATES["llama3ish"]


def test_token_str(tok):
    ids = tok.encode(" Paris 🎉")
    strs = [tok.token_str(i) for i in ids]
    assert strs[0] == " Paris"
    assert tok.token_str(tok.end_of_turn_id) == "<|im_end|>"


# ── multi-turn prefix property ──────────────────────────────────────────────────────────────────
@dataclass
class PrefixReuse:
    """Per turn transition: (common prefix length, len(prev prompt + reply + EOT), len(next prompt))."""

    turns: list[tuple[int, int, int]]

    @property
    def reuse_fraction(self) -> float:
        """Share of the previous prompt + reply found again at the start of the next prompt (1.0 = ideal)."""
        return sum(c for c, _, _ in self.turns) / max(1, sum(p for _, p, _ in self.turns))

    @property
    def cached_fraction(self) -> float:
        """Share of the next prompts' tokens that a prefix cache could serve."""
        return sum(c for c, _, _ in self.turns) / max(1, sum(n for _, _, n in self.turns))

    @property
    def exact(self) -> bool:
        """True when every next prompt starts with the whole previous prompt + reply."""
        return all(c == p for c, p, _ in self.turns)


def chat_prefix_fraction(tok: Tokenizer, user_turns: Sequence[str], reply_ids: Sequence[Sequence[int]],
                         system: str | None = None, keep_ids: bool = False) -> PrefixReuse:
    """How much of each turn's prompt is the previous prompt + the reply as the model sampled it.

    For turn n: prev = prompt_n + reply_ids[n] (+ the end-of-turn id unless the reply ends in an
    EOS id), next = prompt_{n+1} (the chat with the decoded reply appended and the next user
    message). The prefix cache can serve exactly their longest common prefix. `keep_ids`: build
    next with `apply_chat_template(prefix_ids=prev)`, as a session that keeps its ids would.
    """
    if len(reply_ids) < len(user_turns) - 1:
        raise ValueError("need a reply for every turn but the last")
    msgs: list[dict] = [{"role": "system", "content": system}] if system is not None else []
    turns: list[tuple[int, int, int]] = []
    msgs.append({"role": "user", "content": user_turns[0]})
    prompt = tok.apply_chat_template(msgs)
    for n in range(1, len(user_turns)):
        reply = list(reply_ids[n - 1])
        prev = prompt + reply
        if not reply or reply[-1] not in tok.eos_token_ids:
            if tok.end_of_turn_id is not None:
                prev.append(tok.end_of_turn_id)
        text = tok.decode([t for t in reply if t not in tok.eos_token_ids])
        msgs = msgs + [{"role": "assistant", "content": text},
                       {"role": "user", "content": user_turns[n]}]
        prompt = tok.apply_chat_template(msgs, prefix_ids=prev if keep_ids else None)
        turns.append((_common_prefix(prev, prompt), len(prev), len(prompt)))
    return PrefixReuse(turns)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


USER_TURNS = ["Hi! Who are you?", "Tell me a fact about the sea.", "Why is it salty?",
              "Summarize that in one line.", "Thanks, bye!"]
REPLIES = ["I am SmolLM, an AI assistant.", "The ocean covers about 71% of Earth's surface.",
           "Rivers carry dissolved minerals into it, and evaporation leaves the salt behind.",
           "Minerals flow in; water evaporates; salt stays.", "You're welcome!"]


def test_prefix_property_exact_on_default_template(tok):
    replies = [tok.encode(r) for r in REPLIES]
    report = chat_prefix_fraction(tok, USER_TURNS, replies)
    assert report.exact and report.reuse_fraction == 1.0
    assert 0.5 < report.cached_fraction < 1.0
    with_eos = [r + [tok.end_of_turn_id] for r in replies]                            # as sampled: ends in EOS
    assert chat_prefix_fraction(tok, USER_TURNS, with_eos, system="Be brief.").exact


def test_prefix_property_breaks_on_retokenization(tok):
    # A reply the model spelled with non-canonical tokens: " Paris" as " Par" + "is".
    odd = tok.encode(" Par") + tok.encode("is")
    assert odd != tok.encode(" Paris")
    report = chat_prefix_fraction(tok, USER_TURNS[:2], [odd])
    assert not report.exact and report.reuse_fraction < 1.0


TRIM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINK_STRIP_TEMPLATE = (
    "{% for m in messages %}{% set c = m.content %}"
    "{% if m.role == 'assistant' and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_prefix_property_breaks_on_trim_and_reasoning_strip(tok):
    trailing = [tok.encode(r + "\n") for r in REPLIES]                               # a reply ending in "\n"
    assert chat_prefix_fraction(tok, USER_TURNS, trailing).exact                       # ChatML keeps it
    assert not chat_prefix_fraction(tok.with_chat_template(TRIM_TEMPLATE), USER_TURNS, trailing).exact
    thinking = [tok.encode("<think>\nhmm\n</think>\n" + r) for r in REPLIES]
    assert chat_prefix_fraction(tok, USER_TURNS, thinking).exact
    stripped = chat_prefix_fraction(tok.with_chat_template(THINK_STRIP_TEMPLATE), USER_TURNS, thinking)
    assert not stripped.exact and stripped.reuse_fraction < 0.9


def test_prefix_ids_keep_a_non_canonical_reply(tok):
    odd = tok.encode(" Par") + tok.encode("is") + tok.encode(" is nice.")
    assert chat_prefix_fraction(tok, USER_TURNS[:3], [odd, tok.encode("Yes.")], keep_ids=True).exact
    msgs = [{"role": "user", "content": USER_TURNS[0]}]
    prev = tok.apply_chat_template(msgs) + odd + [tok.end_of_turn_id]
    msgs += [{"role": "assistant", "content": tok.decode(odd)}, {"role": "user", "content": USER_TURNS[1]}]
    ids = tok.apply_chat_template(msgs, prefix_ids=prev)
    assert ids[: len(prev)] == prev and ids != tok.apply_chat_template(msgs)
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(msgs)       # same text, model's tokens
    # the text no longer starts with the cached ids (history rewritten): plain tokenization
    msgs[1]["content"] = "Something else"
    assert tok.apply_chat_template(msgs, prefix_ids=prev) == tok.apply_chat_template(msgs)
    # reasoning stripped from history: the cached reply cannot be kept
    think = tok.encode("<think>\nhmm\n</think>\n") + odd
    stripped = tok.with_chat_template(THINK_STRIP_TEMPLATE)
    assert not chat_prefix_fraction(stripped, USER_TURNS[:2], [think], keep_ids=True).exact


# ── template choice, tool messages, continue_final_message (rendered by transformers) ───────────────
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
    "({{ c.function.arguments }}){% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
]


def test_tool_calls_and_tool_messages_render_through_the_template(tok, hf):
    t = tok.with_chat_template(TOOL_TEMPLATE)
    text = t.render_chat(TOOL_CHAT, tools=TOOLS)
    assert 'CALL get_weather({"city": "Paris"})' in text and "18 C, sunny [c1]" in text
    assert text == hf.apply_chat_template(TOOL_CHAT, chat_template=TOOL_TEMPLATE, tools=TOOLS,
                                          add_generation_prompt=True, tokenize=False)
    with pytest.raises(ValueError, match="rejected"):       # the schema checks tool_calls; the template fails cleanly
        t.render_chat([{"role": "assistant", "tool_calls": "not a list"}])


def test_per_request_template_and_continue_final_message(tok, hf):
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    text = tok.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The colour is") and text == hf.apply_chat_template(
        msgs, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="cannot both"):
        tok.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)
    per_request = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}{{ greeting }}"
    assert tok.render_chat(msgs[:1], chat_template=per_request, greeting="hey") == "user=Name a colour.;hey"
    assert tok.chat_template != per_request                     # the model's template is unchanged


def test_chat_template_flag_accepts_a_file_json_or_text(tmp_path):
    from chatserve.text import load_chat_template
    (tmp_path / "t.jinja").write_text(TOOL_TEMPLATE)
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": TOOL_TEMPLATE}))
    assert load_chat_template(str(tmp_path / "t.jinja")) == TOOL_TEMPLATE
    assert load_chat_template(str(tmp_path / "t.json")) == TOOL_TEMPLATE
    assert load_chat_template(TOOL_TEMPLATE) == TOOL_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
