"""The `response_format` request field: pydantic models and the StructuredSpec a request asks for.

OpenAI's `text`, `json_object` and `json_schema`, plus the extensions peers offer under the same field:
`regex`, `choice` and `grammar` (GBNF/EBNF as llama.cpp users write it, or Lark). Not compilation
(compiler.py): this only checks the shape and that a JSON Schema is itself valid.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatserve.structured.spec import StructuredSpec

MAX_SOURCE_CHARS = 200_000   # a schema or grammar bigger than this is refused before compiling
MAX_CHOICES = 1024


class RequestFieldError(ValueError):
    """A malformed constraint or tool field; `param` names it (the HTTP layer answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="allow")
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text" | "json_object" | "json_schema" | "regex" | "choice" | "grammar", ...}`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]
    json_schema: JSONSchemaFormat | None = None
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    syntax: Literal["gbnf", "ebnf", "lark"] = "gbnf"


def schema_spec(schema: Any, param: str) -> StructuredSpec:
    """A json_schema spec after checking the schema against its metaschema (draft 2020-12)."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise RequestFieldError(f"'{param}' must be a JSON Schema object", param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise RequestFieldError(f"'{param}' is not a valid JSON Schema at {where}: {e.message}", param) from None
    # key order kept: properties are generated in the order the schema lists them
    source = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(source) > MAX_SOURCE_CHARS:
        raise RequestFieldError(f"'{param}' is longer than {MAX_SOURCE_CHARS} characters", param)
    return StructuredSpec("json_schema", source)


def response_format_spec(value: Any) -> StructuredSpec | None:
    """The constraint `response_format` asks for (None for absent or `text`). Raises RequestFieldError."""
    if value is None:
        return None
    try:
        rf = ResponseFormat.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RequestFieldError(f"'response_format{'.' + loc if loc else ''}': {first['msg']}",
                                "response_format") from None
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredSpec("json_object")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestFieldError("'response_format.json_schema.schema' is required for type json_schema",
                                    "response_format.json_schema")
        return schema_spec(rf.json_schema.schema_, "response_format.json_schema.schema")
    if rf.type == "regex":
        if not rf.regex:
            raise RequestFieldError("'response_format.regex' is required for type regex", "response_format.regex")
        return StructuredSpec("regex", _bounded(rf.regex, "response_format.regex"))
    if rf.type == "choice":
        if not rf.choices or len(rf.choices) > MAX_CHOICES or not all(rf.choices):
            raise RequestFieldError(f"'response_format.choices' must list 1..{MAX_CHOICES} non-empty strings",
                                    "response_format.choices")
        return StructuredSpec("choice", _bounded(json.dumps(rf.choices, ensure_ascii=False),
                                                 "response_format.choices"))
    if not rf.grammar:
        raise RequestFieldError("'response_format.grammar' is required for type grammar", "response_format.grammar")
    return StructuredSpec("lark" if rf.syntax == "lark" else "grammar", _bounded(rf.grammar, "response_format.grammar"))


def _bounded(text: str, param: str) -> str:
    if len(text) > MAX_SOURCE_CHARS:
        raise RequestFieldError(f"'{param}' is longer than {MAX_SOURCE_CHARS} characters", param)
    return text
