"""Tokenizer: a model's text ↔ token ids (a `tokenizers` backend built by loading.py) and its chat template.

Exact per-token bytes for logprobs and the detokenizer; end-of-turn and EOS ids. Chat rendering is
chat_template.py's, loading loading.py's, streaming detokenization detokenizer.py's. No torch here.
"""
from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

from chatserve.text import chat_template as chat_template_module
from chatserve.text.loading import load_backend, save_meta, source_key

# Added tokens that end a turn or a document in common model families (llama.cpp calls these "EOG"):
# a model that samples one of them is done, whatever its nominal EOS is.
_END_OF_GENERATION_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "</s>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>", "<EOT>",
)
# gpt-oss's harmony format: `<|end|>` ends one message of a reply (its reasoning, a preamble), not the
# turn; `<|return|>` (the answer is done) and `<|call|>` (a tool call waits for its result) end the turn.
_HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>")
_HARMONY_END_OF_TURN = ("<|return|>", "<|call|>")
_PROBE = "Zq7Xv"  # an assistant reply that no template rewrites, used to find the end-of-turn token

_memo: dict[str, "Tokenizer"] = {}
_memo_lock = threading.Lock()


class Tokenizer:
    """A model's tokenizer plus its chat template. Immutable after construction; thread-safe."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        name: str | None = None,
        end_of_turn_probe: list[int] | None = None,
    ) -> None:
        """end_of_turn_probe: what `_probe_end_of_turn` found for this backend and template in an earlier
        load ([id], or [] for nothing), kept in the tokenizer's disk cache; None: probe now. The probe
        renders the template, and the renderer's first import (transformers) is seconds of a start."""
        self._backend = backend
        self.name = name
        self.chat_template = chat_template
        self._special_tokens_map = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token
        self._extra_eos = tuple(int(i) for i in extra_eos_token_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()  # id → AddedToken
        self._special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_ids: frozenset[int] = frozenset(added)
        self.bos_token_id: int | None = self._token_id(self._special_tokens_map.get("bos_token"))
        self.eos_token_id: int | None = self._token_id(self._special_tokens_map.get("eos_token"))
        self._byte_level = _decoder_type(backend) == "ByteLevel"
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()} if self._byte_level else {}
        self._offload: tuple[Callable[[str], list[int]], int] | None = None   # see with_offload
        self._token_str_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}
        if end_of_turn_probe is None:
            probed = self._probe_end_of_turn()
            end_of_turn_probe = [] if probed is None else [probed]
        self.end_of_turn_probe: list[int] = list(end_of_turn_probe)
        self.end_of_turn_id: int | None = self.end_of_turn_probe[0] if self.end_of_turn_probe else None
        if self.end_of_turn_id is None:
            self.end_of_turn_id = self.eos_token_id
        eos = {i for i in (self.eos_token_id, self.end_of_turn_id) if i is not None}
        eos.update(i for i in self._extra_eos if 0 <= i < self.vocab_size)
        harmony = all(backend.token_to_id(t) in self._special_ids for t in _HARMONY_MARKERS)
        for text in _HARMONY_END_OF_TURN if harmony else _END_OF_GENERATION_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None and tid in self._special_ids:
                eos.add(tid)
        if harmony:
            eos.discard(backend.token_to_id("<|end|>"))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # ── loading ──────────────────────────────────────────────────────────────────────────────────
    @classmethod
    def from_model(cls, path: str, *, cache_dir: str | os.PathLike | None = None,
                   use_cache: bool = True) -> "Tokenizer":
        """Load from a GGUF file (tokenizer + chat template in its metadata) or an HF model directory.

        The tokenizer built from a GGUF is cached on disk (`cache_dir`, default $CHATSERVE_CACHE_DIR or
        ~/.cache/chatserve) as a tokenizer.json, and in-process, so later loads skip the conversion.
        """
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"no model at {path}")
        key = source_key(p)
        with _memo_lock:
            if use_cache and key in _memo:
                return _memo[key]
        cdir = None if cache_dir is None else Path(cache_dir)
        backend, meta = load_backend(p, cache_dir=cdir, use_cache=use_cache)
        tok = cls._from_meta(backend, meta, name=str(p))
        if use_cache and _probe_list(meta.get("end_of_turn_probe")) is None:   # probed now: saved for the next load
            save_meta(p, {**meta, "end_of_turn_probe": tok.end_of_turn_probe}, cache_dir=cdir)
        if use_cache:
            with _memo_lock:
                _memo[key] = tok
        return tok

    @classmethod
    def _from_meta(cls, backend: tokenizers.Tokenizer, meta: dict, name: str | None) -> "Tokenizer":
        return cls(
            backend,
            chat_template=meta.get("chat_template"),
            special_tokens=meta.get("special_tokens") or {},
            add_bos_token=meta.get("add_bos_token"),
            add_eos_token=meta.get("add_eos_token"),
            extra_eos_token_ids=meta.get("extra_eos_token_ids") or (),
            name=name,
            end_of_turn_probe=_probe_list(meta.get("end_of_turn_probe")),
        )

    def with_chat_template(self, chat_template: str | None) -> "Tokenizer":
        """The same tokenizer under another chat template (a user override, or a template study)."""
        return Tokenizer(
            self._backend, chat_template=chat_template, special_tokens=self._special_tokens_map,
            add_bos_token=self._add_bos, add_eos_token=self._add_eos,
            extra_eos_token_ids=self._extra_eos, name=self.name,
        )

    def with_offload(self, encode_big: Callable[[str], list[int]], threshold: int) -> "Tokenizer":
        """The same tokenizer, except that a text of `threshold` characters or more (without special tokens
        added) is encoded by `encode_big`: the same ids computed in another process (the prompt guard's
        helper), so a huge prompt does not hold the event loop's GIL. Chat templates encode through it too."""
        t = copy.copy(self)
        t._offload = (encode_big, threshold)
        return t

    # ── text ↔ ids ───────────────────────────────────────────────────────────────────────────────
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text in it (e.g. "<|im_end|>") becomes that special token."""
        if not add_special_tokens:
            if self._offload is not None and len(text) >= self._offload[1]:
                return self._offload[0](text)
            return self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos is None and self._add_eos is None:
            return self._backend.encode(text, add_special_tokens=True).ids  # the tokenizer.json post-processor
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self._add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token as text, for logprobs display (a partial UTF-8 character shows as U+FFFD)."""
        s = self._token_str_cache.get(token_id)
        if s is None:
            s = self._backend.decode([token_id], skip_special_tokens=False)
            self._token_str_cache[token_id] = s
        return s

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (OpenAI's `bytes` field in logprobs)."""
        b = self._token_bytes_cache.get(token_id)
        if b is None:
            b = self._token_bytes_cache[token_id] = self._compute_token_bytes(token_id)
        return b

    def _compute_token_bytes(self, token_id: int) -> bytes:
        tok = self._backend.id_to_token(token_id)
        if tok is None:
            return b""
        if token_id in self._added_ids:
            return tok.encode("utf-8")
        if self._byte_level:
            try:
                return bytes(self._byte_decoder[c] for c in tok)
            except KeyError:
                return tok.encode("utf-8")
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tok)  # sentencepiece byte fallback
        if m:
            return bytes([int(m.group(1), 16)])
        return tok.replace("\u2581", " ").encode("utf-8")

    @property
    def is_byte_level(self) -> bool:
        """Byte-level BPE (GPT-2 style): decoding is the concatenation of each token's bytes."""
        return self._byte_level

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens` drops."""
        return self._special_ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` tokenizer underneath (the prompt guard copies it into its helper process)."""
        return self._backend

    def _token_id(self, text: str | None) -> int | None:
        return None if text is None else self._backend.token_to_id(text)

    # ── chat template ────────────────────────────────────────────────────────────────────────────
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    continue_final_message: bool = False, **chat_template_kwargs: Any) -> str:
        """The prompt text for a conversation, as transformers' `apply_chat_template(tokenize=False)`.

        chat_template: a per-request template instead of the model's. continue_final_message: end the
        prompt inside the last (assistant) message, so the model continues it. Raises ValueError (fit
        for a 400 response) when there is no template, the messages are malformed, or the template
        rejects them (e.g. roles that do not alternate).
        """
        template = chat_template or self.chat_template
        if not template:
            model = f"the model {self.name}" if self.name else "this model"
            raise ValueError(f"{model} has no chat template; use the completions endpoint, or start "
                             "the server with --chat-template FILE_OR_STRING")
        return chat_template_module.render(
            template, list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message, special_tokens=self._special_tokens_map,
            **chat_template_kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            continue_final_message: bool = False, prefix_ids: Sequence[int] | None = None,
                            **chat_template_kwargs: Any) -> list[int]:
        """Prompt token ids: the rendered template (see render_chat), tokenized without adding special
        tokens.

        `prefix_ids` (optional): the ids already in the KV cache for this chat — the previous prompt +
        the reply as sampled + the end-of-turn id. When the new text starts with exactly their text and
        they end in a special token (a hard tokenization boundary), they are kept verbatim and only the
        rest is tokenized: the prefix cache then hits even for a reply the model spelled with
        non-canonical tokens. Otherwise the plain tokenization is returned. Server-side state only:
        ids from a client would let it place arbitrary tokens in the prompt.
        """
        text = self.render_chat(messages, add_generation_prompt, tools=tools, chat_template=chat_template,
                                continue_final_message=continue_final_message, **chat_template_kwargs)
        if prefix_ids and prefix_ids[-1] in self._special_ids:
            head = self.decode(prefix_ids, skip_special_tokens=False)
            if text.startswith(head):
                return list(prefix_ids) + self.encode(text[len(head):], add_special_tokens=False)
        return self.encode(text, add_special_tokens=False)

    def _probe_end_of_turn(self) -> int | None:
        """The special token a template writes right after an assistant message (<|im_end|>, <|eot_id|>…)."""
        if not self.chat_template:
            return None
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render_chat(msgs, add_generation_prompt=False)
        except Exception:  # a template that insists on a system prompt, etc.: no probe
            return None
        at = text.rfind(_PROBE)
        if at < 0:
            return None
        ids = self.encode(text[at + len(_PROBE):].lstrip())
        return ids[0] if ids and ids[0] in self._special_ids else None

    # ── multi-turn prefix reuse ──────────────────────────────────────────────────────────────────


def _probe_list(value: Any) -> list[int] | None:
    """A cached end-of-turn probe ([id] or []), or None when the cache has none (or a malformed one)."""
    if isinstance(value, list) and len(value) <= 1 and all(type(i) is int for i in value):
        return list(value)
    return None


def _decoder_type(backend: tokenizers.Tokenizer) -> str | None:
    dec = backend.decoder
    return None if dec is None else type(dec).__name__


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest map to 256+n."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table

