"""Loading a tokenizer from a GGUF file's metadata or an HF directory, with a disk cache of the result.

Returns a `tokenizers` backend plus a small metadata dict (chat template, special tokens, BOS/EOS rules);
the Tokenizer class (tokenizer.py) is built from them. No chat rendering here.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from chatserve import disk_cache
from chatserve.text.chat_template import pick_template

log = logging.getLogger("chatserve.text")
CACHE_FORMAT = 1  # bump when what the disk cache stores changes
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_backend(p: Path, *, cache_dir: Path | None = None, use_cache: bool = True
                 ) -> tuple[tokenizers.Tokenizer, dict]:
    """(backend, meta) for a GGUF file or an HF directory; converted once, then read from the disk
    cache (`cache_dir`, default the shared chatserve cache's tokenizers/ folder)."""
    key = source_key(p)
    cdir = cache_dir if cache_dir is not None else disk_cache.cache_dir("tokenizers")
    loaded = read_cache(cdir, key) if use_cache else None
    if loaded is None:
        if not p.is_dir():
            log.info("converting the tokenizer in %s (once; cached in %s)", p.name, cdir)
        loaded = _load_hf_dir(p) if p.is_dir() else _load_gguf(p)
        if use_cache:
            write_cache(cdir, key, *loaded)
    return loaded


def source_key(p: Path) -> str:
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


def read_cache(cdir: Path, key: str) -> tuple[tokenizers.Tokenizer, dict] | None:
    tj, mj = cdir / f"{key}.tokenizer.json", cdir / f"{key}.meta.json"
    try:
        meta = json.loads(mj.read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT:
            return None
        return tokenizers.Tokenizer.from_file(str(tj)), meta
    except Exception:
        return None


def write_cache(cdir: Path, key: str, backend: tokenizers.Tokenizer, meta: dict) -> None:
    try:
        for suffix, data in (("tokenizer.json", backend.to_str()),
                             ("meta.json", json.dumps({**meta, "format": CACHE_FORMAT}))):
            disk_cache.write_atomic(cdir / f"{key}.{suffix}", data.encode("utf-8"))
    except OSError:
        pass  # a read-only home is no reason to fail; the next load converts again


def save_meta(p: Path, meta: dict, *, cache_dir: Path | None = None) -> None:
    """Rewrite the cached metadata of `p`'s tokenizer (what load_backend returned, plus what the Tokenizer
    learned from it: the end-of-turn probe), so that the next load of the same files reads it too."""
    cdir = cache_dir if cache_dir is not None else disk_cache.cache_dir("tokenizers")
    key = source_key(p)
    if not (cdir / f"{key}.tokenizer.json").is_file():
        return                      # no cached backend to go with it (a read-only cache)
    try:
        data = json.dumps({**meta, "format": CACHE_FORMAT})
        disk_cache.write_atomic(cdir / f"{key}.meta.json", data.encode("utf-8"))
    except OSError:
        pass


def _load_gguf(p: Path) -> tuple[tokenizers.Tokenizer, dict]:
    """Build the tokenizer from GGUF metadata with transformers' converter (the fast internal path when
    this transformers version has it, else the public AutoTokenizer)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
        fast = True
    except ImportError:
        fast = False
    if fast:
        try:
            arch, tok_dict, tok_config = get_gguf_tokenizer(str(p))
            backend, _ = convert_gguf_tokenizer(arch, tok_dict)
            meta = {
                "chat_template": tok_config.get("chat_template"),
                "special_tokens": {k: tok_config.get(k) for k in SPECIAL_TOKEN_NAMES},
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
        "special_tokens": {k: getattr(hf, k, None) for k in SPECIAL_TOKEN_NAMES},
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
            "special_tokens": {k: _token_text(config.get(k, special_map.get(k))) for k in SPECIAL_TOKEN_NAMES},
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
        template = pick_template(config["chat_template"])
    elif (d / "chat_template.json").is_file():
        template = pick_template(_read_json(d / "chat_template.json").get("chat_template"))
    meta["chat_template"] = template if template is not None else meta.get("chat_template")
    eos = _read_json(d / "generation_config.json").get("eos_token_id")
    meta["extra_eos_token_ids"] = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    return backend, meta
