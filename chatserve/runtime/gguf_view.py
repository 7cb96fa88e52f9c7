"""`ViewReader`: gguf-py's GGUFReader parsing the header over a plain ndarray view of its memory map, with
metadata arrays built in one pass.

The one GGUF reader chatserve opens files with (the loader, weights.gguf_reader, and the header check,
model_source/gguf_check.CheckedReader, which subclasses it). Not a loader: no tensor is dequantized here.
"""
from __future__ import annotations

import struct
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

GGUF_MAGIC = b"GGUF"
# gguf-py versions whose GGUFReader._get_field_parts ViewReader._array_parts was checked against (the same
# parts, data indices and types; tests/runtime/test_gguf_view.py compares every field). Any other version
# parses with gguf-py's own method.
CHECKED_GGUF_VERSIONS = frozenset({"0.19.0"})
_STRING, _ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY
_U64 = struct.Struct("=Q")      # a string's length, in host order (the fast path reads host-order files only)


def _gguf_version() -> str:
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


FAST_ARRAYS = _gguf_version() in CHECKED_GGUF_VERSIONS


def is_gguf_file(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic, whatever its name (Ollama's blobs have no suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class ViewReader(GGUFReader):
    """gguf-py's reader (0.19.0), two costs removed, same `fields` and `tensors`:

    - slicing a np.memmap runs memmap.__array_finalize__ on every one of the ~10^5 small reads the reader
      makes for a 49k-token vocabulary; over an ndarray view of the same mapping the bytes are the same and
      the reads are plain slices;
    - gguf-py builds a metadata array item by item through `_get_field_parts` (a recursive call, an enum
      and three numpy views per item: seconds for the vocabulary, merges and token types). `_array_parts`
      builds the same parts (a [1] length view and a uint8 data view per string, a [1] view per number,
      each into the mapped file) in one loop, for arrays of strings or numbers in a host-order file.
      Nested arrays, byte-swapped files and gguf versions not in CHECKED_GGUF_VERSIONS take gguf-py's path.
    """

    _u64_views: list[np.ndarray] | None = None

    def _get(self, *args: Any, **kwargs: Any) -> Any:
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # same bytes, a plain array type
        return super()._get(*args, **kwargs)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int],
                                                                        list[GGUFValueType]]:
        if raw_type == _ARRAY and FAST_ARRAYS and self.byte_order == "I":
            parts = self._array_parts(orig_offs)
            if parts is not None:
                return parts
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_parts(self, offs: int) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]] | None:
        """(bytes, parts, data indices, types) of the array at `offs`, as gguf-py's _get_field_parts gives
        them; None for an array it must read (nested arrays, unknown item types)."""
        raw_itype, alen = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1:
            return None                          # past the end: gguf-py raises its own error
        itype, count = int(raw_itype[0]), int(alen[0])
        head: list[np.ndarray] = [raw_itype, alen]
        if count == 0:                           # gguf-py records no item type for an empty array
            return 12, head, [], [_ARRAY]
        start = offs + 12
        if itype == _STRING:
            size, items = self._string_items(start, count)
            return 12 + size, head + items, list(range(3, 2 * count + 2, 2)), [_ARRAY, _STRING]
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(itype)) if itype in _SCALAR_CODES else None
        if scalar is None:
            return None
        dtype = np.dtype(scalar).newbyteorder(self.byte_order)
        size = count * dtype.itemsize
        data: np.ndarray = self.data  # a plain ndarray view (see _get)
        if start + size > len(data):
            raise ValueError(f"a metadata array of {count} items at byte {offs} runs past the end of the file")
        items = list(data[start:start + size].view(dtype).reshape(count, 1))   # [1] views, as gguf-py's
        return 12 + size, head + items, list(range(2, count + 2)), [_ARRAY, GGUFValueType(itype)]

    def _string_items(self, offs: int, count: int) -> tuple[int, list[np.ndarray]]:
        """(bytes, [length, data] × count) of `count` strings from `offs`: a uint64 [1] view of each length
        and a uint8 view of each string's bytes, both into the mapped file."""
        data: np.ndarray = self.data  # a plain ndarray view (see _get)
        end, buf = len(data), memoryview(data)  # type: ignore[arg-type]  # an ndarray is a buffer
        if 8 * count > end - offs:      # each string takes at least its 8-byte length
            raise ValueError(f"a string array of {count} items runs past the end of the file")
        if self._u64_views is None:     # uint64 views of the file at byte shifts 0..7: a length at `o` is
            u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)      # one slice of view o % 8
            self._u64_views = [data[s:s + (end - s) // 8 * 8].view(u64) for s in range(8)]
        views, unpack, start = self._u64_views, _U64.unpack_from, offs
        items: list[np.ndarray] = [None] * (2 * count)  # type: ignore[list-item]  # every slot is set below
        for i in range(0, 2 * count, 2):
            if offs + 8 > end:
                raise ValueError(f"a string array of {count} items runs past the end of the file")
            n = unpack(buf, offs)[0]
            j = offs >> 3
            items[i] = views[offs & 7][j:j + 1]
            offs += 8
            if offs + n > end:
                raise ValueError(f"a string array of {count} items runs past the end of the file")
            items[i + 1] = data[offs:offs + n]
            offs += n
        return offs - start, items


_SCALAR_CODES = frozenset(int(t) for t in GGUFReader.gguf_scalar_to_np)
