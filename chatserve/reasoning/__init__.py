"""Reasoning ("thinking") kept apart from the answer: text-level parsers of `<think>…</think>` output
and of gpt-oss's harmony channels.

One parser per request (`parser_for(name, prompt_text)`), fed text deltas; it returns
(reasoning_delta, content_delta) pairs. `choose_parser_name` picks a parser from the chat template and the
model family. Imports nothing from the server or the engine.
"""
from chatserve.reasoning.parser import PARSERS, ReasoningParser, ThinkTagParser, needs_special_tokens, parser_for
from chatserve.reasoning.select import choose_parser_name, resolve_parser_name, thinking_switch

__all__ = ["PARSERS", "ReasoningParser", "ThinkTagParser", "needs_special_tokens", "parser_for", "choose_parser_name",
           "resolve_parser_name", "thinking_switch"]
