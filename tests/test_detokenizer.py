"""IncrementalDetokenizer: UTF-8-safe deltas, stop strings across token boundaries, O(new tokens) pushes."""
from __future__ import annotations

import random
import time

import pytest

from chatserve.config import default_model_path
from chatserve.text import IncrementalDetokenizer, Tokenizer

MODEL = default_model_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason="default model not installed")

MIXED = ("Emoji 🎉🚀👩‍👩‍👧 and CJK 你好世界、日本語のテキスト, 한국어; accents naïve café — "
         "math ∑∫√ and a flag 🇫🇷. Done.")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model(MODEL)


def stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    deltas, i = [], 0
    for n in chunks or [1] * len(ids):
        deltas.append(d.push(ids[i:i + n]))
        i += n
    deltas.append(d.flush())
    return deltas, d


def test_multibyte_split_over_tokens_never_yields_replacement(tok):
    ids = tok.encode(MIXED)
    split = [i for i in ids if "\ufffd" in tok.token_str(i)]
    assert len(split) >= 5  # the text really does cut characters between tokens
    deltas, d = stream(tok, ids)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.text == MIXED == tok.decode(ids)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_matches_full_decode(tok, seed):
    rng = random.Random(seed)
    text = MIXED + " " + "".join(rng.choice("ab 你🎉\n,é") for _ in range(200))
    ids = tok.encode(text)
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.randint(1, 4)))
        left -= chunks[-1]
    deltas, d = stream(tok, ids, chunks)
    assert all("\ufffd" not in x for x in deltas)
    assert d.text == text


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|>")
    assert stream(tok, ids)[1].text == "Hi"
    assert stream(tok, ids, skip_special_tokens=False)[1].text == "Hi<|im_end|>"


def test_prompt_tail_gives_same_text_as_full_decode(tok):
    prompt = tok.encode("The capital of France is")
    out = tok.encode(" Paris, a city of 2 million.")
    d = IncrementalDetokenizer(tok, prompt_tail=prompt)
    text = "".join(d.push([i]) for i in out) + d.flush()
    assert text == tok.decode(prompt + out)[len(tok.decode(prompt)):]


def test_invalid_utf8_is_not_lost(tok):
    lone = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\xf0"][0]   # lead byte, no tail
    ids = tok.encode("a") + [lone] + tok.encode("b")
    deltas, d = stream(tok, ids)
    assert d.text == tok.decode(ids) and "\ufffd" in d.text                      # real garbage shows
    deltas, d = stream(tok, tok.encode("x") + [lone])
    assert deltas[-1] == "\ufffd" and d.text == "x\ufffd"                           # flush emits the held tail


def run_stop(tok, text, stop, **kw):
    ids = tok.encode(text)
    deltas, d = stream(tok, ids, stop=stop, **kw)
    return "".join(deltas), d


def test_stop_string_across_token_boundaries(tok):
    text = "The answer is 42. END OF ANSWER and more text"
    stop = "D OF AN"  # starts inside " END" and ends inside " ANSWER"
    ids = tok.encode(text)
    assert not any(stop in tok.token_str(i) for i in ids)
    out, d = run_stop(tok, text, [stop])
    assert out == "The answer is 42. EN" == d.text and d.stopped and d.stop_str == stop
    assert d.push(tok.encode(" more")) == "" and d.flush() == ""                  # nothing after a stop
    out, d = run_stop(tok, text, [stop], include_stop_str=True)
    assert out == "The answer is 42. END OF AN"


def test_stop_prefix_is_held_then_released(tok):
    d = IncrementalDetokenizer(tok, stop=["Hello world"])
    got = "".join(d.push([i]) for i in tok.encode("Say Hello"))
    assert got == "Say "                                                             # "Hello" might start the stop
    got += "".join(d.push([i]) for i in tok.encode(" there"))
    assert got == "Say Hello there" and not d.stopped                              # it did not: released
    d = IncrementalDetokenizer(tok, stop=["Hello world"])
    got = "".join(d.push([i]) for i in tok.encode("Say Hello wor")) + d.flush()
    assert got == "Say Hello wor" and not d.stopped                                # finish: partial match is text


def test_earliest_of_several_stops_wins(tok):
    out, d = run_stop(tok, "alpha beta gamma delta", ["delta", "beta", "gam"])
    assert out == "alpha " and d.stop_str == "beta"
    out, d = run_stop(tok, "你好世界，再见", ["世界"])
    assert out == "你好"


def test_stop_inside_one_chunk_of_many_tokens(tok):
    ids = tok.encode("one two three four")
    d = IncrementalDetokenizer(tok, stop=["two"])
    assert d.push(ids) == "one " and d.stopped


def test_push_cost_does_not_grow_with_length(tok):
    ids = tok.encode(MIXED * 60)[:4000]
    d = IncrementalDetokenizer(tok, stop=["</answer>", "STOP HERE"])
    times = []
    for i in ids:
        t0 = time.perf_counter()
        d.push([i])
        times.append(time.perf_counter() - t0)
    first, last = sorted(times[200:1200])[500], sorted(times[-1000:])[500]          # medians
    assert last < 3 * first + 50e-6, (first, last)
    assert sum(times) / len(times) < 1e-3
    print(f"push: median {first * 1e6:.1f} µs early, {last * 1e6:.1f} µs late")


def test_random_ids_stream_equals_full_decode(tok):
    """Any id sequence (garbage bytes, specials included) streams to exactly what decode() gives."""
    rng = random.Random(0)
    for skip in (True, False):
        ids = [rng.randrange(tok.vocab_size) for _ in range(600)] + list(range(17))
        rng.shuffle(ids)
        deltas, d = stream(tok, ids, skip_special_tokens=skip)
        assert d.text == tok.decode(ids, skip_special_tokens=skip)


# ── the window path: a sentencepiece-style tokenizer (Metaspace, byte fallback), built in memory ──
def sentencepiece_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "H", "e", "l", "o", "w", "r", "d", "你", "好", "▁Hello", "▁world", "ll", "He", "Hell",
             "▁H", "▁He", "▁Hel", "▁w", "▁wo", "▁wor", "▁worl", "or", "Hel", "!"]
    vocab = {p: i for i, p in enumerate(pieces + words)}
    merges = [("H", "e"), ("He", "l"), ("Hel", "l"), ("▁", "H"), ("▁H", "e"), ("▁He", "l"),
              ("▁Hel", "l"), ("▁Hell", "o"), ("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"),
              ("▁worl", "d")]
    vocab["▁Hell"] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    backend = Backend(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def test_window_path_sentencepiece():
    sp = sentencepiece_tokenizer()
    assert not sp.is_byte_level
    text = "Hello world 🎉 你好 ∑ Hello"
    ids = sp.encode(text)
    assert sum(1 for i in ids if sp.token_str(i) == "\ufffd") >= 4    # byte-fallback pieces of 🎉 and ∑
    assert sp.decode(ids) == text
    for chunks in (None, [2] * (len(ids) // 2) + [len(ids) % 2] if len(ids) % 2 else [2] * (len(ids) // 2)):
        deltas, d = stream(sp, ids, chunks)
        assert all("\ufffd" not in x for x in deltas) and d.text == text
    # prompt context keeps the leading space of the first generated piece
    prompt = sp.encode("Hello")
    full = sp.encode("Hello world")
    assert full[: len(prompt)] == prompt and sp.decode(full[len(prompt):]) == "world"  # alone: no space
    out = full[len(prompt):]
    d = IncrementalDetokenizer(sp, prompt_tail=prompt)
    assert "".join(d.push([i]) for i in out) + d.flush() == " world"
    out_text, d = run_stop(sp, "Hello world 🎉 你好", ["d 🎉"])
    assert out_text == "Hello worl" and d.stopped
    # the window stays small on a long stream
    d = IncrementalDetokenizer(sp)
    for i in sp.encode(text * 50):
        d.push([i])
    assert len(d._ids) <= 8 and d.text + d.flush() == text * 50
