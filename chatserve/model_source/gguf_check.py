"""A GGUF file's header read and checked before its weights are: the magic, metadata that parses, a known
type for every tensor and every tensor's bytes inside the file; then the architecture (`ArchConfig`).

Reads only the header (gguf-py maps the file; no tensor page is touched). Not the loader (weights.py).
"""
from __future__ import annotations

from pathlib import Path

import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from chatserve.model_source.errors import ModelCheckError
from chatserve.model_source.hub import one_line
from chatserve.runtime.arch_config import ArchConfig, UnsupportedModelError, gguf_config
from chatserve.runtime.gguf_view import GGUF_MAGIC as MAGIC, ViewReader, is_gguf_file  # noqa: F401  (re-exported)


class CheckedReader(ViewReader):
    """The shared GGUF reader (runtime/gguf_view.py), refusing unknown tensor types and tensors past the
    end of the file with one line each (the plain reader fails on them with a reshape error). Metadata
    arrays of more than BIG_ARRAY items (the tokenizer's vocabulary, merges, scores) are stepped over,
    their contents left empty: the checks and the architecture do not read them, and gguf-py reads them
    item by item (seconds for a 150k vocabulary); the tokenizer and the loader read the file again with
    the full reader."""

    BIG_ARRAY = 4096

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type == GGUFValueType.ARRAY:
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            if int(count[0]) > self.BIG_ARRAY and int(itype[0]) != GGUFValueType.ARRAY:
                size = 12 + self._items_size(orig_offs + 12, GGUFValueType(int(itype[0])), int(count[0]))
                return size, [itype, count], [], [GGUFValueType.ARRAY, GGUFValueType(int(itype[0]))]
        return super()._get_field_parts(orig_offs, raw_type)

    def _items_size(self, offs: int, itype: GGUFValueType, count: int) -> int:
        """Bytes of `count` items of `itype` from `offs` (strings: a u64 length, then the bytes)."""
        if itype != GGUFValueType.STRING:
            return count * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
        fmt, start, end = (">Q" if self.byte_order == "S" else "<Q"), offs, len(self.data)
        buf = memoryview(self.data)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's memmap stub says not
        for _ in range(count):
            if offs + 8 > end:
                raise ValueError(f"a string array of {count} items runs past the end of the file")
            offs += 8 + struct.unpack_from(fmt, buf, offs)[0]
        return offs - start

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size, end, first_past = len(self.data), 0, None
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                raise ModelCheckError(f"tensor {name} has type {int(raw_dtype[0])}, which no GGUF reader here "
                                      f"knows (a newer quant format? update the gguf package)") from None
            tensor_end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block
            end = max(end, tensor_end)
            if tensor_end > size and first_past is None:
                first_past = name
        if end > size:
            raise ModelCheckError(f"truncated: the file has {size:,} bytes but its tensors end at byte {end:,} "
                                  f"({end - size:,} missing, from tensor {first_past} on; an interrupted "
                                  f"download?)")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    """The checked reader of `path`; ModelCheckError naming what is wrong with it."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ModelCheckError(f"{p} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
    try:
        return CheckedReader(str(p))
    except ModelCheckError as e:
        raise ModelCheckError(f"{p}: {e}") from None
    except Exception as e:     # gguf-py's IndexError/ValueError/UnicodeDecodeError on a damaged header
        raise ModelCheckError(f"{p} is a corrupt GGUF file: its metadata does not parse "
                              f"({type(e).__name__}: {one_line(e)})") from None


def gguf_arch_config(path: str | Path) -> ArchConfig:
    """The architecture of a checked GGUF file (UnsupportedModelError for one chatserve does not run)."""
    reader = open_gguf(path)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    try:
        return gguf_config(reader, shapes)
    except UnsupportedModelError:
        raise
    except Exception as e:     # a key missing or of the wrong type in the metadata
        raise ModelCheckError(f"{path}: its metadata does not describe a model chatserve can read "
                              f"({type(e).__name__}: {one_line(e)})") from None
