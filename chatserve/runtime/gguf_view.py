"""`ViewReader`: gguf-py's GGUFReader parsing the header over a plain ndarray view of its memory map.

The one GGUF reader chatserve opens files with (the loader, weights.gguf_reader, and the header check,
model_source/gguf_check.CheckedReader, which subclasses it). Not a loader: no tensor is dequantized here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic, whatever its name (Ollama's blobs have no suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class ViewReader(GGUFReader):
    """Slicing a np.memmap runs memmap.__array_finalize__ on every one of the ~10^6 small reads the reader
    makes for a 49k-token vocabulary (most of its load time); over an ndarray view of the same mapping the
    bytes are the same and the reads are plain slices."""

    def _get(self, *args: Any, **kwargs: Any) -> Any:
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # same bytes, a plain array type
        return super()._get(*args, **kwargs)
