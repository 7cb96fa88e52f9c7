"""The tool fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`) as a typed ToolPlan.

A plan says what reaches the chat template, which grammar (if any) forces the output — a JSON array
of calls for "required", the function's arguments for a named choice — and how output is read back.
Not parsing output (parsers.py) and not the prompt fallback's wording (prompt.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from chatserve.structured.response_format import RequestFieldError, schema_spec
from chatserve.structured.spec import StructuredSpec
from chatserve.toolcalls.parsers import PARSERS, ForcedArrayParser, ForcedNamedParser, ToolCallParser
from chatserve.toolcalls.stream import ToolCallStream

MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


@dataclass
class ToolPlan:
    tools: list[dict]                      # as the template wants them: [{"type": "function", "function": …}]
    choice: str                            # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    parser_name: str = "hermes"
    constraint: StructuredSpec | None = None
    _schemas: dict[str, dict] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def parser(self) -> ToolCallParser:
        if self.choice == "named":
            return ForcedNamedParser(self.named or "")
        if self.choice == "required":
            return ForcedArrayParser()
        return PARSERS[self.parser_name]()

    def streamer(self) -> ToolCallStream:
        return ToolCallStream(self.parser())


def _error(e: ValidationError, param: str) -> RequestFieldError:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    return RequestFieldError(f"'{param}{'.' + loc if loc else ''}': {first['msg']}", param)


def tool_plan(raw_tools: list[dict[str, Any]] | None, raw_choice: str | dict[str, Any] | None,
              parallel: bool | None, parser_name: str) -> ToolPlan | None:
    """The plan for a request's tool fields (their outer types already validated by the request schema),
    or None when it has no tools. Raises RequestFieldError."""
    if not raw_tools:
        if raw_choice not in (None, "none", "auto"):
            raise RequestFieldError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if len(raw_tools) > MAX_TOOLS:
        raise RequestFieldError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    tools: list[Tool] = []
    for i, t in enumerate(raw_tools):
        try:
            tools.append(Tool.model_validate(t))
        except ValidationError as e:
            err = _error(e, f"tools[{i}]")
            raise RequestFieldError(str(err), "tools") from None
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in schemas:
            raise RequestFieldError(f"'tools' has two functions named {tool.function.name!r}", f"tools[{i}]")
        params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
        schema_spec(params, f"tools[{i}].function.parameters")        # a 400 for an invalid schema
        schemas[tool.function.name] = params
    plan = ToolPlan(tools=[tool.model_dump(exclude_none=True) for tool in tools], choice="auto",
                    parallel=True if parallel is None else parallel, parser_name=parser_name, _schemas=schemas)
    if raw_choice is None or isinstance(raw_choice, str):
        plan.choice = raw_choice or "auto"
    else:
        try:
            named = NamedToolChoice.model_validate(raw_choice)
        except ValidationError as e:
            raise RequestFieldError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                    "{\"type\": \"function\", \"function\": {\"name\": …}}", "tool_choice") from e
        if named.function.name not in schemas:
            raise RequestFieldError(f"'tool_choice' names {named.function.name!r}, which is not in 'tools'",
                                    "tool_choice")
        plan.choice, plan.named = "named", named.function.name
    if plan.choice == "named" and plan.named is not None:
        plan.constraint = schema_spec(schemas[plan.named], "tools.function.parameters")
    elif plan.choice == "required":
        plan.constraint = schema_spec(required_calls_schema(schemas, plan.parallel), "tools")
    return plan


def required_calls_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """A JSON array of one or more calls (exactly one without parallel calls), each naming a tool and
    carrying arguments that validate against that tool's parameters."""
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": name}, "arguments": params}}
             for name, params in schemas.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema

