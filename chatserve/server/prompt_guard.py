"""A model's bound on client text (bytes that cannot fit its context are refused before tokenizing) and
its tokenizer process, where big texts are encoded without stalling the event loop.

The admission path that applies them is admission.py. Not the validation rules (protocol.py).
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from chatserve.server.errors import APIError
from chatserve.text.tokenizer import Tokenizer

# Above this many bytes of client text, parsing runs in a worker thread and the encode itself in the
# tokenizer process: the `tokenizers` encode holds the GIL for its whole run (measured in
# docs/reliability.md), and even encode_batch, which releases it, frees its result under the GIL.
BIG_INPUT_BYTES = 16 << 10
DEFAULT_MAX_TOKEN_BYTES = 256     # when the tokenizer cannot list its vocabulary
TOKEN_BYTES_SLACK = 4


PROMPT_FIELDS = ("messages", "prompt", "content", "system_prompt")   # where a body carries prompt text


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string in a parsed JSON value (keys included)."""
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(text_bytes(k) + text_bytes(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(text_bytes(v) for v in value)
    return 0


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes of text one token can stand for, so that a prompt of more than
    max_model_len × this many bytes can never fit the context.

    Every id decoded alone (one batched call), plus TOKEN_BYTES_SLACK for what decoding a token alone
    can hide (a SentencePiece decoder drops a leading space); a partial UTF-8 character decodes to
    U+FFFD, which only over-counts. Without a `tokenizers` backend: the longest vocabulary entry in
    UTF-8, also an upper bound. (A normalizer that shrinks text would break the bound; none of the
    supported families has one.)"""
    backend = getattr(tokenizer, "backend", None)      # None: a tokenizer without a `tokenizers` backend
    try:
        if backend is None:
            raise LookupError("no tokenizers backend")
        n = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return max(len(t.encode("utf-8", "surrogatepass")) for t in texts) + TOKEN_BYTES_SLACK
    except Exception:
        pass
    try:
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else tokenizer.get_vocab()
        return max(len(t.encode("utf-8", "surrogatepass")) for t in vocab)
    except Exception:
        return DEFAULT_MAX_TOKEN_BYTES


# ---- the tokenizer process -------------------------------------------------------------------------
_worker_backend: Any = None


def _worker_init(backend_json: str, parent_pid: int) -> None:
    global _worker_backend
    import tokenizers
    _worker_backend = tokenizers.Tokenizer.from_str(backend_json)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    """A pool worker holds both ends of its task queue, so it never sees the server die (SIGKILL):
    leave when the parent is gone instead of lingering as an orphan."""
    import time
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _worker_encode(text: str) -> list[int]:
    return _worker_backend.encode(text, add_special_tokens=False).ids


class TokenizerProcess:
    """One helper process holding a copy of the `tokenizers` backend; `encode()` blocks its caller (a
    worker thread), never the event loop, and the GIL stays free while the helper works."""

    def __init__(self, backend: Any) -> None:
        self._json = backend.to_str()
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _get(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_worker_init,
                                                 initargs=(self._json, os.getpid()))
            return self._pool

    def start(self) -> None:
        """Spawn the helper now (chatserve serve does at startup) instead of at the first big prompt."""
        self._get().submit(len, "").result()

    def encode(self, text: str) -> list[int]:
        return self._get().submit(_worker_encode, text).result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


# ---- admission ---------------------------------------------------------------------------------------
class PromptGuard:
    """Per-server bound on client text: max_model_len × max_token_bytes bytes (see max_token_bytes)."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.max_bytes = max_model_len * max_token_bytes(tokenizer)
        self.process: TokenizerProcess | None = None
        self.tokenizer = tokenizer
        if isinstance(tokenizer, Tokenizer):          # a real tokenizer: big texts encode in the helper
            self.process = TokenizerProcess(tokenizer.backend)
            self.tokenizer = tokenizer.with_offload(self.process.encode, BIG_INPUT_BYTES)

    def check_size(self, nbytes: int, param: str | None) -> None:
        if nbytes > self.max_bytes:
            raise APIError(400, f"the input is {nbytes:,} bytes of text; this model's context of "
                           f"{self.max_model_len:,} tokens holds at most {self.max_bytes:,} bytes of it",
                           param=param, code="context_length_exceeded")

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


def param_of(body: dict) -> str | None:
    """The body's prompt-bearing field (the `param` of a too-long error)."""
    for k in PROMPT_FIELDS:
        if k in body:
            return k
    return None


def prompt_bytes(body: dict) -> int:
    """UTF-8 bytes of the prompt-bearing fields of a request body (PROMPT_FIELDS): what tokenizing reads."""
    return sum(text_bytes(body[k]) for k in PROMPT_FIELDS if k in body)
