"""Grammar engines compared on the default model's vocabulary: compile time, mask time, JSON Schema coverage.

`python -m chatserve.bench.grammar_engines` measures llguidance and xgrammar (whichever are installed)
the way chatserve uses them; the figures and the choice are in docs/benchmarks.md. Not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

# Schemas exercising the keywords users send (OpenAI strict mode, pydantic, JSONSchemaBench's common ones).
COVERAGE_SCHEMAS: dict[str, dict] = {
    "nested objects + enum + array": {
        "type": "object", "additionalProperties": False, "required": ["name", "address", "tags", "level"],
        "properties": {"name": {"type": "string"}, "level": {"enum": ["low", "mid", "high"]},
                       "tags": {"type": "array", "items": {"type": "string"}},
                       "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                                   "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}}}},
    "$defs + $ref": {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
                     "type": "object", "properties": {"a": {"$ref": "#/$defs/P"}}, "required": ["a"]},
    "recursive $ref": {"$defs": {"N": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/N"}}}, "required": ["v"]}},
        "$ref": "#/$defs/N"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"const": 2}}, "required": ["b"]}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "const + nullable type list": {"type": "object", "properties": {"k": {"const": "v"},
                                                                    "n": {"type": ["string", "null"]}}},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "string min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "format date-time/email/uuid": {"type": "object", "properties": {
        "t": {"type": "string", "format": "date-time"}, "e": {"type": "string", "format": "email"},
        "u": {"type": "string", "format": "uuid"}}},
    "number minimum/maximum": {"type": "number", "minimum": 0, "maximum": 10},
    "integer exclusiveMinimum": {"type": "integer", "exclusiveMinimum": 0},
    "array min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if/then/else": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    "not": {"not": {"type": "string"}},
}

# An instance each schema forbids: an engine that compiles the schema but accepts this has not enforced it.
INVALID_INSTANCES: dict[str, Any] = {
    "oneOf": {"a": 1, "b": 2}, "allOf": {"a": 1}, "string pattern": "ab-123", "string min/maxLength": "abcdefg",
    "number minimum/maximum": 11, "integer exclusiveMinimum": 0, "array min/maxItems": [1, 2, 3, 4],
    "multipleOf": 7, "uniqueItems": [1, 1], "if/then/else": {"a": 1}, "not": "x",
    "patternProperties": {"x_a": "s"}, "additionalProperties schema": {"k": "s"},
}

MASK_SCHEMA = COVERAGE_SCHEMAS["nested objects + enum + array"]
MASK_DOC = {"name": "Ada Lovelace, mathematician and writer", "level": "high",   # schema order: both
            "tags": ["analytical engine", "notes", "Bernoulli numbers", "poetry"],  # engines keep it
            "address": {"city": "London", "zip": 12345}}


def _tokenizer():
    from chatserve.config import default_model_path
    from chatserve.text import Tokenizer
    return Tokenizer.from_model(default_model_path())


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class _Engine:
    name = ""

    def compile(self, schema: dict) -> Any: raise NotImplementedError
    def matcher(self, compiled: Any) -> Any: raise NotImplementedError
    def accept(self, m: Any, tok: int) -> bool: raise NotImplementedError
    def fill(self, ms: list[Any], bitmask: torch.Tensor) -> None: raise NotImplementedError
    def can_end(self, m: Any) -> bool: raise NotImplementedError


class _LLGuidance(_Engine):
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        from chatserve.structured.compiler import ll_tokenizer
        self.ll = llguidance
        self.tok = ll_tokenizer(tok, vocab)

    def compile(self, schema: dict) -> Any:
        from chatserve.structured.compiler import JSON_OPTIONS
        g = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        err = self.ll.LLMatcher.validate_grammar(g, self.tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(err)
        return self.ll.LLMatcher(self.tok, g)     # construction compiles the lexer

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def accept(self, m: Any, tok: int) -> bool:
        return m.consume_token(tok)

    def can_end(self, m: Any) -> bool:
        return m.is_accepting()

    def fill(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(ms):   # one after the other, as chatserve.runtime.grammar_masks does
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), bitmask.shape[1] * 4)


class _XGrammar(_Engine):
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar
        self.xg = xgrammar
        ids = range(vocab)
        info = xgrammar.TokenizerInfo([tok.token_bytes(i) if i < tok.vocab_size else b"" for i in ids],
                                      vocab_type=xgrammar.VocabType.RAW, vocab_size=vocab,
                                      stop_token_ids=sorted(tok.eos_token_ids))
        self.info = info
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict) -> Any:
        # a fresh compiler each time: its own cache would hide the compile cost
        return self.xg.GrammarCompiler(self.info, cache_enabled=False).compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xg.GrammarMatcher(compiled)

    def accept(self, m: Any, tok: int) -> bool:
        return m.accept_token(tok)

    def can_end(self, m: Any) -> bool:
        return m.accept_token(self.info.stop_token_ids[0])

    def fill(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(ms, bitmask)


def _engines(tok, vocab: int) -> list[_Engine]:
    out: list[_Engine] = []
    for cls in (_LLGuidance, _XGrammar):
        try:
            out.append(cls(tok, vocab))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    return out


def _accepts(engine: _Engine, compiled: Any, ids: list[int]) -> bool:
    """Whether the engine lets the whole token sequence through and then lets it end."""
    m = engine.matcher(compiled)
    return all(engine.accept(m, t) for t in ids) and engine.can_end(m)


def measure(engine: _Engine, tok, vocab: int, batches: tuple[int, ...] = (1, 16)) -> dict:
    res: dict[str, Any] = {"engine": engine.name}
    ok, failed = [], {}
    for name, schema in COVERAGE_SCHEMAS.items():
        try:
            engine.compile(schema)
            ok.append(name)
        except Exception as e:  # noqa: BLE001 — an unsupported keyword is a data point here
            failed[name] = str(e).splitlines()[0][:100]
    res["coverage"] = f"{len(ok)}/{len(COVERAGE_SCHEMAS)}"
    res["unsupported"] = failed
    res["compiled_but_not_enforced"] = [name for name in ok if name in INVALID_INSTANCES and _accepts(
        engine, engine.compile(COVERAGE_SCHEMAS[name]), tok.encode(json.dumps(INVALID_INSTANCES[name],
                                                                                separators=(",", ":"))))]
    res["compile_ms"] = round(_timed(lambda: engine.compile(MASK_SCHEMA), 5)[0] * 1e3, 2)
    compiled = engine.compile(MASK_SCHEMA)
    doc_ids = tok.encode(json.dumps(MASK_DOC, separators=(",", ":")))
    warm = engine.matcher(compiled)    # one pass first: lazily built lexer states are then warm, as in serving
    for t in doc_ids:
        engine.fill([warm], torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32))
        engine.accept(warm, t)
    for b in batches:
        ms = [engine.matcher(compiled) for _ in range(b)]
        bitmask = torch.zeros(b, (vocab + 31) // 32, dtype=torch.int32)
        times = []
        for t in doc_ids:
            t0 = time.perf_counter()
            engine.fill(ms, bitmask)
            times.append(time.perf_counter() - t0)
            for m in ms:
                if not engine.accept(m, t):
                    raise RuntimeError(f"{engine.name} rejected token {t} of a valid document")
        res[f"mask_us_batch{b}"] = round(statistics.median(times) * 1e6, 1)
        res[f"mask_us_batch{b}_p90"] = round(sorted(times)[int(0.9 * len(times))] * 1e6, 1)
    return res


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    torch.set_num_threads(1)
    tok = _tokenizer()
    vocab = tok.vocab_size
    print(f"vocabulary: {vocab} tokens")
    for e in _engines(tok, vocab):
        print(json.dumps(measure(e, tok, vocab), indent=1))


if __name__ == "__main__":
    main()
