"""StructuredSpec → a validated, compiled llguidance grammar for one model's vocabulary, cached by spec.

Compiling is where a bad schema, an unsupported keyword or an unparsable grammar is found, so the HTTP
layer compiles before it queues a request (a 400 naming the problem, no token generated). Not the
per-request matching state (runtime/grammar_masks.py); no torch here.
"""
from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING
import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions      # the TypedDict of grammar_from_json_schema's options

from chatserve.core.protocols import TokenizerLike
from chatserve.structured.spec import StructuredSpec

# JSON as models write it (indented or not), but whitespace between tokens is bounded: a run of at most
# 16 spaces/newlines, so a small model sampling at temperature 1 cannot spend max_tokens on newlines.
# oneOf is enforced as anyOf (pydantic writes oneOf for unions whose branches rarely overlap).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True, "coerce_one_of": True,
                                    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
CACHE_SIZE = 256
ENCODE_CACHE_SIZE = 4096     # distinct strings llguidance asked to tokenize, kept per tokenizer table


@dataclass(frozen=True)
class CompiledGrammar:
    """A fresh llguidance matcher used only as a template (each request deep-copies it), and the
    vocabulary size its bitmasks cover."""

    template: llguidance.LLMatcher
    vocab_size: int


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message names the problem (fit for a 400)."""


class _TokenTable:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each id's bytes, EOS, specials, encode."""

    def __init__(self, tok: TokenizerLike, vocab_size: int) -> None:
        n = int(tok.vocab_size)
        specials = set(tok.special_token_ids)
        eos = sorted(tok.eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tok.bos_token_id
        # ids past the tokenizer (a model's padded vocabulary) are specials nobody can sample
        self.special_token_ids = sorted(specials | set(range(n, vocab_size)))
        self.tokens = [(tok.token_bytes(i) if i < n else b"") or b"<|pad|>" for i in range(vocab_size)]
        self._encode = tok.encode
        self._encoded: dict[str | bytes, list[int]] = {}

    def __call__(self, text: str | bytes) -> list[int]:
        """Token ids of a text, remembered: llguidance tokenizes the bytes a grammar forces (a key
        name, `","`) while it computes masks, the same few strings over and over, each time calling
        back into Python from the mask fill."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= ENCODE_CACHE_SIZE:
                self._encoded.clear()
            ids = self._encoded[text] = self._encode(
                text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
        return list(ids)


def ll_tokenizer(tok: TokenizerLike, vocab_size: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over the model's whole vocabulary (ids >= tok.vocab_size are padding)."""
    eos = sorted(tok.eos_token_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tok, vocab_size)),
                                  n_vocab=vocab_size, eos_token=eos or None)


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for a spec (JSON Schema, regex, Lark; GBNF/EBNF is translated to Lark)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        options = json.loads(spec.source)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    if spec.kind == "grammar":
        try:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
        except Exception as e:  # noqa: BLE001 — the translator raises plain exceptions on bad input
            raise GrammarError(f"the grammar does not parse as GBNF/EBNF: {e}") from None
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    raise GrammarError(f"unknown constraint kind {spec.kind!r}")


class GrammarCompiler:
    """Compiles specs for one tokenizer + vocabulary size; an LRU of compiled grammars keyed by spec.

    llguidance builds its lexer lazily and its parser needs no table, so a "compile" is validation plus
    a template matcher; each request's matcher is a deep copy of it (cheap).
    """

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self._tok = tokenizer
        self.vocab_size = int(vocab_size)
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: collections.OrderedDict[tuple[str, str], CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self._tok, self.vocab_size)
            return self._ll

    def compile(self, spec: StructuredSpec) -> StructuredSpec:
        """The spec with its compiled grammar attached. Raises GrammarError naming the problem."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return replace(spec, compiled=hit)
        template = CompiledGrammar(self._build(spec), self.vocab_size)
        with self._lock:
            self.misses += 1
            self._cache[spec.key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return replace(spec, compiled=template)

    def _build(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        grammar = grammar_text(spec)
        tok = self.ll_tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise GrammarError(_describe(spec, messages[0] if messages else "rejected"))
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_describe(spec, m.get_error()))
        return m


def _describe(spec: StructuredSpec, err: str) -> str:
    what = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice list", "grammar": "grammar", "lark": "Lark grammar"}.get(spec.kind, spec.kind)
    return f"invalid {what}: {err.strip()[:400]}"


_compilers: dict[tuple[int, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: TokenizerLike, vocab_size: int) -> GrammarCompiler:
    """The process's one compiler (and cache) for this tokenizer and vocabulary size."""
    key = (id(tokenizer), int(vocab_size))
    with _compilers_lock:
        c = _compilers.get(key)
        if c is None:
            c = _compilers[key] = GrammarCompiler(tokenizer, vocab_size)
        return c
