"""Reasoning ("thinking") kept apart from the answer: text-level parsers of `<think>…</think>` output.

One parser per request (`parser_for(name, prompt_text)`), fed text deltas; it returns
(reasoning_delta, content_delta) pairs. `choose_parser_name` picks a parser from the chat template and the
model family. Imports nothing from the server or the engine.
"""
from chatserve.reasoning.parser import PARSERS, ReasoningParser, ThinkTagParser, parser_for
from chatserve.reasoning.select import choose_parser_name, resolve_parser_name, thinking_switch

__all__ = ["PARSERS", "ReasoningParser", "ThinkTagParser", "parser_for", "choose_parser_name",
           "resolve_parser_name", "thinking_switch"]
