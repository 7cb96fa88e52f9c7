"""What a request constrains its output to: a plain, hashable description of a grammar.

Pure Python (it rides on SamplingParams through chatserve/core). Not the compiled grammar
(compiler.py) and not the per-request matcher state (runtime/grammar_masks.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "lark"]


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint. `source` is canonical text (a JSON Schema dumped compactly, a regex,
    a JSON list of choices, a GBNF/EBNF or Lark grammar): equal specs compile to one cached grammar."""

    kind: Kind
    source: str = ""
    compiled: Any = field(default=None, compare=False, hash=False, repr=False)  # set by the compiler

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.source)
