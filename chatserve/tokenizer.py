"""Text ↔ token ids for a model: the tokenizer, its chat template, and a streaming detokenizer.

`Tokenizer` wraps a `tokenizers` (Rust) tokenizer built from a GGUF file's metadata or an HF directory and
renders chat templates with transformers' semantics. `IncrementalDetokenizer` turns sampled ids into
UTF-8-safe text deltas and matches stop strings. No torch here; no model, no sampling.
"""
from __future__ import annotations

import codecs
import datetime
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

CACHE_FORMAT = 1  # bump when what the disk cache stores changes

# Added tokens that end a turn or a document in common model families (llama.cpp calls these "EOG"):
# a model that samples one of them is done, whatever its nominal EOS is.
_END_OF_GENERATION_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "</s>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>", "<EOT>",
)
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # aliased as transformers does
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
    ) -> None:
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
        self._token_str_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}
        self.end_of_turn_id: int | None = self._probe_end_of_turn()
        if self.end_of_turn_id is None:
            self.end_of_turn_id = self.eos_token_id
        eos = {i for i in (self.eos_token_id, self.end_of_turn_id) if i is not None}
        eos.update(i for i in self._extra_eos if 0 <= i < self.vocab_size)
        for text in _END_OF_GENERATION_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None and tid in self._special_ids:
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # ── loading ──────────────────────────────────────────────────────────────────────────────────
    @classmethod
    def from_model(cls, path: str, *, cache_dir: str | os.PathLike | None = None,
                   use_cache: bool = True) -> "Tokenizer":
        """Load from a GGUF file (tokenizer + chat template in its metadata) or an HF model directory.

        The tokenizer built from a GGUF is cached on disk (`cache_dir`, default $CHATSERVE_CACHE_DIR or
        ~/.cache/chatserve) as a tokenizer.json, and in-process, so later loads take ~0.1 s.
        """
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"no model at {path}")
        key = _source_key(p)
        with _memo_lock:
            if use_cache and key in _memo:
                return _memo[key]
        cdir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        loaded = _read_cache(cdir, key) if use_cache else None
        if loaded is None:
            if p.is_dir():
                loaded = _load_hf_dir(p)
            else:
                loaded = _load_gguf(p)
            if use_cache:
                _write_cache(cdir, key, *loaded)
        backend, meta = loaded
        tok = cls._from_meta(backend, meta, name=str(p))
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
        )

    def with_chat_template(self, chat_template: str | None) -> "Tokenizer":
        """The same tokenizer under another chat template (a user override, or a template study)."""
        return Tokenizer(
            self._backend, chat_template=chat_template, special_tokens=self._special_tokens_map,
            add_bos_token=self._add_bos, add_eos_token=self._add_eos,
            extra_eos_token_ids=self._extra_eos, name=self.name,
        )

    # ── text ↔ ids ───────────────────────────────────────────────────────────────────────────────
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text in it (e.g. "<|im_end|>") becomes that special token."""
        if not add_special_tokens:
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

    def _token_id(self, text: str | None) -> int | None:
        return None if text is None else self._backend.token_to_id(text)

    # ── chat template ────────────────────────────────────────────────────────────────────────────
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """The prompt text for a conversation, as transformers' `apply_chat_template(tokenize=False)`.

        Raises ValueError (fit for a 400 response) when the model has no template, the messages are
        malformed, or the template itself rejects them (e.g. roles that do not alternate).
        """
        if not self.chat_template:
            model = f"the model {self.name}" if self.name else "this model"
            raise ValueError(f"{model} has no chat template; use the completions endpoint "
                             "or configure a chat template")
        msgs = _normalize_messages(messages)
        if tools is not None:
            _check_plain(tools, "tools")
        for k, v in template_kwargs.items():
            _check_plain(v, k)
        template = _compile_template(self.chat_template)
        context = {**self._special_tokens_map, **template_kwargs}
        try:
            return template.render(messages=msgs, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context)
        except _jinja().TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ValueError(f"the chat template could not render these messages: {e}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, prefix_ids: Sequence[int] | None = None,
                            **template_kwargs: Any) -> list[int]:
        """Prompt token ids: the rendered template, tokenized without adding special tokens.

        `prefix_ids` (optional): the ids already in the KV cache for this chat — the previous prompt +
        the reply as sampled + the end-of-turn id. When the new text starts with exactly their text and
        they end in a special token (a hard tokenization boundary), they are kept verbatim and only the
        rest is tokenized: the prefix cache then hits even for a reply the model spelled with
        non-canonical tokens. Otherwise the plain tokenization is returned. Server-side state only:
        ids from a client would let it place arbitrary tokens in the prompt.
        """
        text = self.render_chat(messages, add_generation_prompt, tools=tools, **template_kwargs)
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
    def chat_prefix_fraction(self, user_turns: Sequence[str], reply_ids: Sequence[Sequence[int]],
                             system: str | None = None, keep_ids: bool = False) -> "PrefixReuse":
        """How much of each turn's prompt is the previous prompt + the reply as the model sampled it.

        For turn n: prev = prompt_n + reply_ids[n] (+ the end-of-turn id unless the reply ends in an
        EOS id), next = prompt_{n+1} (the chat with the decoded reply appended and the next user
        message). The prefix cache can serve exactly their longest common prefix. `keep_ids`: build
        next with `apply_chat_template(prefix_ids=prev)`, as a session that keeps its ids would.
        """
        if len(reply_ids) < len(user_turns) - 1:
            raise ValueError("need a reply for every turn but the last")
        msgs: list[dict] = [{"role": "system", "content": system}] if system is not None else []
        turns: list[tuple[int, int, int]] = []
        msgs.append({"role": "user", "content": user_turns[0]})
        prompt = self.apply_chat_template(msgs)
        for n in range(1, len(user_turns)):
            reply = list(reply_ids[n - 1])
            prev = prompt + reply
            if not reply or reply[-1] not in self.eos_token_ids:
                if self.end_of_turn_id is not None:
                    prev.append(self.end_of_turn_id)
            text = self.decode([t for t in reply if t not in self.eos_token_ids])
            msgs = msgs + [{"role": "assistant", "content": text},
                           {"role": "user", "content": user_turns[n]}]
            prompt = self.apply_chat_template(msgs, prefix_ids=prev if keep_ids else None)
            turns.append((_common_prefix(prev, prompt), len(prev), len(prompt)))
        return PrefixReuse(turns)


@dataclass
class PrefixReuse:
    """Per turn transition: (common prefix length, len(prev prompt + reply + EOT), len(next prompt))."""

    turns: list[tuple[int, int, int]]

    @property
    def reuse_fraction(self) -> float:
        """Share of the previous prompt + reply found again at the start of the next prompt (1.0 = ideal)."""
        return sum(c for c, _, _ in self.turns) / max(1, sum(p for _, p, _ in self.turns))

    @property
    def cached_fraction(self) -> float:
        """Share of the next prompts' tokens that a prefix cache could serve."""
        return sum(c for c, _, _ in self.turns) / max(1, sum(n for _, _, n in self.turns))

    @property
    def exact(self) -> bool:
        """True when every next prompt starts with the whole previous prompt + reply."""
        return all(c == p for c, p, _ in self.turns)


class IncrementalDetokenizer:
    """Sampled ids → text deltas safe to stream, with stop strings matched across token boundaries.

    Byte-level tokenizers: each token's bytes go through an incremental UTF-8 decoder, which holds an
    incomplete character until its last byte arrives (exact, O(1) per token).
    Other tokenizers (sentencepiece: leading-space rules, byte-fallback tokens): a small window of ids
    is re-decoded each push: `prefix` ids give context (e.g. a leading space), text past `read` is
    new; a tail that decodes to U+FFFD (a character cut between tokens) is held until it completes.
    Text that might be the start of a stop string is held until it cannot be.
    """

    _MAX_WINDOW = 32  # window path: a character is at most 4 byte tokens; past this, U+FFFD is real

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True, prompt_tail: list[int] | None = None) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop_str
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._stop_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if tokenizer.is_byte_level else None
        self._ids: list[int] = list(prompt_tail or [])[-4:]  # window path: a few context ids suffice
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._sent = 0           # window path: chars past prefix_text already emitted
        self._held = ""          # decoded but held back: could be the start of a stop string
        self._parts: list[str] = []
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        if self._utf8 is not None:
            skip = self._tok.special_token_ids if self._skip else ()
            data = b"".join(self._tok.token_bytes(t) for t in token_ids if t not in skip)
            return self._emit(self._utf8.decode(data), final=False)
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids)
        new = window_text[len(self._prefix_text) + self._sent:]
        if window_text.endswith("\ufffd") and len(self._ids) - self._read < self._MAX_WINDOW:
            safe = new.rstrip("\ufffd")  # everything before the incomplete character is final
            self._sent += len(safe)
            return self._emit(safe, final=False)
        self._advance()
        return self._emit(new, final=False)

    def flush(self) -> str:
        """At finish: whatever is still held (an incomplete character, a partial stop string)."""
        if self.stopped:
            return ""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
        else:
            delta = self._decode(self._ids)[len(self._prefix_text) + self._sent:]
            self._advance()
        return self._emit(delta, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _advance(self) -> None:
        """Window path: emitted text now ends at the last id; the old read offset becomes the prefix."""
        del self._ids[: self._read]  # keep memory and decode work bounded
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._sent = 0

    def _emit(self, delta: str, final: bool) -> str:
        if not self._stops:
            out = delta
        else:
            buf = self._held + delta
            hit = _earliest_stop(buf, self._stops)
            if hit is not None:
                at, s = hit
                out = buf[: at + len(s)] if self._include_stop else buf[:at]
                self._held, self.stopped, self.stop_str = "", True, s
            elif final:
                out, self._held = buf, ""
            else:
                keep = 0
                for k in range(min(len(buf), self._max_stop - 1), 0, -1):
                    if buf[-k:] in self._stop_prefixes:
                        keep = k
                        break
                out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self._parts.append(out)
        return out


# ── helpers ──────────────────────────────────────────────────────────────────────────────────────
def _earliest_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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


def _check_plain(value: Any, where: str) -> None:
    """Template inputs must be plain JSON data (the template runs in a sandbox; objects do not go in)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: keys must be strings")
            _check_plain(v, f"{where}.{k}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    raise ValueError(f"{where}: unsupported value of type {type(value).__name__}")


def _normalize_messages(messages: Any) -> list[dict]:
    """Validate messages and prepare them as transformers does: None-valued keys dropped, reasoning aliased."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
        if isinstance(content, list) and not all(isinstance(p, Mapping) for p in content):
            raise ValueError(f"messages[{i}].content parts must be objects")
        _check_plain(m, f"messages[{i}]")
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# ── jinja environment (same semantics as transformers' chat templates) ──────────────────────────
@lru_cache(maxsize=1)
def _jinja():  # noqa: ANN202 - the jinja2 module, imported on first use
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    return jinja2


@lru_cache(maxsize=1)
def _environment():  # noqa: ANN202
    jinja2 = _jinja()
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

        tags = {"generation"}

        def parse(self, parser):  # noqa: ANN001, ANN202
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):  # noqa: ANN001, ANN202
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore attributes (no reaching into CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    class PlainDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = PlainDict()
    env.globals["namespace"] = Namespace
    return env


@lru_cache(maxsize=32)
def _compile_template(source: str):  # noqa: ANN202
    try:
        return _environment().from_string(source)
    except _jinja().TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e}") from None


# ── loading from files, and the disk cache ──────────────────────────────────────────────────────
def _default_cache_dir() -> Path:
    root = os.environ.get("CHATSERVE_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "chatserve")
    return Path(root) / "tokenizers"


def _source_key(p: Path) -> str:
    """Changes when the file (or the tokenizer files of a directory) or the converter changes."""
    try:
        from importlib.metadata import version

        tf_version = version("transformers")
    except Exception:
        tf_version = "?"
    parts = [str(p.resolve()), f"fmt{CACHE_FORMAT}", tf_version, tokenizers.__version__]
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    for f in files:
        if f.is_file() and (f == p or f.suffix in (".json", ".jinja", ".model", ".txt")):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _read_cache(cdir: Path, key: str) -> tuple[tokenizers.Tokenizer, dict] | None:
    tj, mj = cdir / f"{key}.tokenizer.json", cdir / f"{key}.meta.json"
    try:
        meta = json.loads(mj.read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT:
            return None
        return tokenizers.Tokenizer.from_file(str(tj)), meta
    except Exception:
        return None


def _write_cache(cdir: Path, key: str, backend: tokenizers.Tokenizer, meta: dict) -> None:
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        for suffix, data in (("tokenizer.json", backend.to_str()),
                             ("meta.json", json.dumps({**meta, "format": CACHE_FORMAT}))):
            fd, tmp = tempfile.mkstemp(dir=cdir, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, cdir / f"{key}.{suffix}")  # atomic: concurrent loaders see old or new
    except OSError:
        pass  # a read-only home is no reason to fail; the next load converts again


def _load_gguf(p: Path) -> tuple[tokenizers.Tokenizer, dict]:
    """Build the tokenizer from GGUF metadata with transformers' converter (the fast internal path when
    this transformers version has it, else the public AutoTokenizer)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        convert_gguf_tokenizer = None
    if convert_gguf_tokenizer is not None:
        try:
            arch, tok_dict, tok_config = get_gguf_tokenizer(str(p))
            backend, _ = convert_gguf_tokenizer(arch, tok_dict)
            meta = {
                "chat_template": tok_config.get("chat_template"),
                "special_tokens": {k: tok_config.get(k) for k in _SPECIAL_TOKEN_NAMES},
                "add_bos_token": bool(tok_config.get("add_bos_token", False)),
                "add_eos_token": bool(tok_config.get("add_eos_token", False)),
            }
            return backend, meta
        except Exception:
            pass  # fall through to the public API, which may know this file better
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return _from_transformers(hf)


def _from_transformers(hf: Any) -> tuple[tokenizers.Tokenizer, dict]:
    if not getattr(hf, "is_fast", True) or getattr(hf, "backend_tokenizer", None) is None:
        raise ValueError("this tokenizer has no fast (tokenizers) form; convert it to tokenizer.json")
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    meta = {
        "chat_template": template,
        "special_tokens": {k: getattr(hf, k, None) for k in _SPECIAL_TOKEN_NAMES},
        "add_bos_token": getattr(hf, "add_bos_token", None),
        "add_eos_token": getattr(hf, "add_eos_token", None),
    }
    return hf.backend_tokenizer, meta


def _token_text(value: Any) -> str | None:
    """tokenizer_config special tokens are strings or serialized AddedTokens ({"content": …})."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _load_hf_dir(d: Path) -> tuple[tokenizers.Tokenizer, dict]:
    config = _read_json(d / "tokenizer_config.json")
    if (d / "tokenizer.json").is_file():
        backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        special_map = _read_json(d / "special_tokens_map.json")
        meta: dict = {
            "special_tokens": {k: _token_text(config.get(k, special_map.get(k))) for k in _SPECIAL_TOKEN_NAMES},
            "add_bos_token": config.get("add_bos_token"),
            "add_eos_token": config.get("add_eos_token"),
        }
    else:  # sentencepiece-only checkpoints: let transformers convert (slow once, then cached)
        from transformers import AutoTokenizer

        backend, meta = _from_transformers(AutoTokenizer.from_pretrained(str(d)))
    template = None
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif config.get("chat_template") is not None:
        template = _pick_template(config["chat_template"])
    elif (d / "chat_template.json").is_file():
        template = _pick_template(_read_json(d / "chat_template.json").get("chat_template"))
    meta["chat_template"] = template if template is not None else meta.get("chat_template")
    eos = _read_json(d / "generation_config.json").get("eos_token_id")
    meta["extra_eos_token_ids"] = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    return backend, meta


def _pick_template(value: Any) -> str | None:
    """A template string, or the "default" entry of a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return None
