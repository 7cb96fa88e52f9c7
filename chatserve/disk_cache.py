"""The one per-user disk cache of chatserve: converted tokenizers and compiled CPU kernels.

Under config.cache_root() ($CHATSERVE_CACHE_DIR, else $XDG_CACHE_HOME/chatserve or ~/.cache/chatserve),
one folder per kind of entry. Writes are atomic, so concurrent processes see the old file or the new one. Pure Python.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from chatserve.config import cache_root


def cache_dir(kind: str) -> Path:
    """The folder for one kind of cached file ("tokenizers", "kernels"); not created here."""
    return cache_root() / kind


def temp_path(target: Path, suffix: str = "") -> str:
    """A fresh temporary file beside `target` (same filesystem, so os.replace onto it is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    return tmp


def write_atomic(target: Path, data: bytes) -> None:
    """Write `data` to `target` so readers see either the old file or the whole new one."""
    tmp = temp_path(target)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
