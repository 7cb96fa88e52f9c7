"""Compatibility re-export for code written before the split into chatserve/text/ (other branches in
flight at merge time); new code imports from chatserve.text."""
from chatserve.text import IncrementalDetokenizer, Tokenizer, load_chat_template

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_chat_template"]
