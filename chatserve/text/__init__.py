"""chatserve.text: text ↔ token ids for a model.

tokenizer.py (`Tokenizer`: encode, decode, token bytes, EOS ids), chat_template.py (rendering through
transformers' template machinery), detokenizer.py (`IncrementalDetokenizer`: streaming, stop strings),
loading.py (GGUF / HF directory → tokenizer, with the disk cache). No torch here.
"""
from chatserve.text.chat_template import load_chat_template
from chatserve.text.detokenizer import IncrementalDetokenizer
from chatserve.text.tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_chat_template"]
