"""The on-disk store of one GGUF file's tiled copies (cpu_blockq8's row-interleaved layout, issue 30): one cache
file per model file, every tiled run end to end, memory-mapped. The first load tiles each run in memory, writes it
to the store's new file and maps it back (the anonymous copy freed); a later load maps the finished file whole and
reads nothing of the GGUF's tiled bands.
Not the tiling itself (cpu_blockq8.tile_into) and not cpu_qmatmul's packed weights (cpu_qmatmul.pack_cached).

Keys read no weight pages: the file is named by the GGUF's path and (st_dev, st_ino, size, mtime_ns) and the
layout version; inside it a run is found by its place in the load order, its format and shape, and each band's
offset in the GGUF with the order its rows are read in (a GGUF's Q/K rows are read back in HF order), so a warm
load touches no page of the GGUF (touching three rows per band cost an 8B model's warm load 0.4 s of page faults).
A band not over the GGUF's map (no `file_span` given, tests) is keyed by three of its rows (first, middle, last)
instead. The layout is the same at every tiled ISA level (chatserve_bq8_tile: one copy serves AVX2 and AVX-512),
so the level is not part of the key.

File: the runs at 2 MiB-aligned offsets (holes between), then a JSON index, then a footer (MAGIC, index offset,
index length). Written under a temporary name and renamed in finish(); an unreadable file is built again; a run
the index lacks (another configuration) is tiled in memory and the file removed at finish(), so the next load
rebuilds it. No eviction: a file stays until its GGUF changes (then the next load replaces it) or is removed.
CHATSERVE_WEIGHT_CACHE=0 turns it off (for_file returns None); the directory is env.weight_cache_dir().
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Callable

import torch
import xxhash

from chatserve_kernels import env
from chatserve_kernels.block_formats import BlockWeight
from chatserve_kernels.cpu_blockq8 import huge_page_buffer

log = logging.getLogger(__name__)
LAYOUT_VERSION = 3          # bump when chatserve_bq8_tile would lay out other bytes for the same blocks, or keys change
MAGIC = b"CSTILED1"
_FOOTER = struct.Struct("<8sQQ")
# each run starts 2 MiB into the file: the page cache holds its pages as large folios (written with pwrite, or read
# ahead) and a map at a 2 MiB-aligned address, advised MADV_HUGEPAGE, maps them as huge pages (ext4, Linux 6.1x:
# smaps FilePmdMapped), as fast to stream as the anonymous huge pages the copy lived in (docs/benchmarks.md)
_ALIGN = 2 << 20
_WRITE = 64 << 20          # bytes per pwrite


def _advise_huge(m: mmap.mmap) -> None:
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def _view(m: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] over m from offset, holding m (and so the mapping) for the tensor's life."""
    with warnings.catch_warnings():          # a read-only map: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)


def _band_sample(w: BlockWeight) -> bytes:
    """Three rows of W (first, middle, last): what a run's key reads of a band not over the model file."""
    rows = sorted({0, w.n // 2, w.n - 1})
    return b"".join(w.row(r).numpy().tobytes() for r in rows)


def _band_id(w: BlockWeight, span: tuple[int, int] | None) -> bytes:
    """Band W in a run's key: its blocks' offset in the model file and its row order (no page read), or, for a
    band not over the file's map (span: its address and length), three of its rows."""
    src, order = w.source()
    at = src.data_ptr() - span[0] if span is not None else -1
    if not (src.is_contiguous() and span is not None and 0 <= at and at + src.numel() <= span[1]):
        return _band_sample(w)
    rows = b"" if order is None else xxhash.xxh3_64_digest(order.numpy().tobytes())
    return f"@{at}".encode() + rows


class TiledStore:
    """The tiled copies of one model file: `run(parts, nbytes)` gives each run's buffer (mapped from the finished
    file, or a fresh region of the file being built for the caller to tile into); `finish()` once the model is
    built publishes a new file."""

    def __init__(self, path: Path, source: list[int], file_span: tuple[int, int] | None = None) -> None:
        self.path, self.source = path, source
        self.seq = 0                               # runs asked so far: the load order is part of a run's key
        self.index: dict[str, list[int]] = {}      # key → [offset, nbytes]
        self.stale = False                         # a run was missing from a mapped file
        self.built = 0                             # bytes tiled into the new file
        self._map: mmap.mmap | None = None         # the finished file, mapped whole
        self._fd: int | None = None                # the file being built
        self._tmp: Path | None = None
        self._size = 0
        self._off = False                          # writing failed once: the rest of this load tiles in memory
        self.file_span = file_span                 # the GGUF's map (address, length): bands on it keyed by offset
        self._open()

    @classmethod
    def for_file(cls, gguf: str | os.PathLike[str], file_span: tuple[int, int] | None = None) -> TiledStore | None:
        """The store of a GGUF file, or None where the weight cache is off. file_span: the address and length of
        the file's map, so that bands over it are keyed by their offset (no page read)."""
        if not env.weight_cache_enabled():
            return None
        real = os.path.realpath(gguf)
        st = os.stat(real)
        source = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
        ident = xxhash.xxh3_64_hexdigest(json.dumps([source, LAYOUT_VERSION]).encode())
        where = xxhash.xxh3_64_hexdigest(real.encode())
        return cls(env.weight_cache_dir() / f"tiled-{where}-{ident}-v{LAYOUT_VERSION}.bin", source, file_span)

    @property
    def mapped(self) -> bool:
        """Runs come from a finished cache file (a warm load)."""
        return self._map is not None

    def _open(self) -> None:
        """Map the finished file and read its index; an unreadable one is left to be rebuilt."""
        try:
            with open(self.path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            magic, at, length = _FOOTER.unpack_from(m, len(m) - _FOOTER.size)
            if magic != MAGIC or at + length + _FOOTER.size != len(m):
                raise ValueError("bad footer")
            meta = json.loads(m[at:at + length])
            if meta.get("version") != LAYOUT_VERSION or meta.get("source") != self.source:
                raise ValueError("another file or layout")
            index = {str(k): [int(v[0]), int(v[1])] for k, v in meta["runs"].items()}
            if any(o % _ALIGN or o + n > at for o, n in index.values()):
                raise ValueError("a run outside the data")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            log.warning("tiled cache %s unreadable (%s): tiling again", self.path.name, e)
            return
        _advise_huge(m)
        self._map, self.index = m, index

    def _key(self, parts: list[BlockWeight]) -> str:
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(f"{p.fmt.name}:{p.n}:{p.k};".encode())
            h.update(_band_id(p, self.file_span))
        return f"{self.seq}:{h.hexdigest()}"

    def run(self, parts: list[BlockWeight], nbytes: int, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """The tiled copy of the next run (bands `parts`, tiled size nbytes) → uint8 [nbytes]: a view of the
        finished file; else `fill` tiles it into anonymous huge-page memory, which is written to the new file and
        mapped back from it (the anonymous copy then freed), or kept where the file cannot be written or the
        mapped file lacks this run."""
        key = self._key(parts)
        self.seq += 1
        if self._map is not None:
            hit = self.index.get(key)
            if hit is not None and hit[1] == nbytes:
                return _view(self._map, hit[0], nbytes)
            self.stale = True
        buf = huge_page_buffer(nbytes)
        fill(buf)
        if self._map is not None or self._off:
            return buf
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._drop_orphans()
                self._tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{id(self):x}.tmp")
                self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            offset = -self._size % _ALIGN + self._size
            view = memoryview(buf.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer; its stubs say otherwise
            for at in range(0, nbytes, _WRITE):                # buffered writes: the page cache keeps large folios
                os.pwrite(self._fd, view[at:at + _WRITE], offset + at)
            m = mmap.mmap(self._fd, nbytes, offset=offset, access=mmap.ACCESS_READ)
        except OSError as e:
            log.warning("tiled cache %s: cannot write (%s): tiling in memory", self.path.name, e)
            self._abandon()
            return buf
        _advise_huge(m)
        self.index[key] = [offset, nbytes]
        self._size = offset + nbytes
        self.built += nbytes
        return _view(m, 0, nbytes)

    def finish(self) -> None:
        """The model is built: publish the new file (index + footer, renamed into place) and drop older files of
        the same GGUF path, then map it (another model built from the same loaded weights finds every run); or
        remove a mapped file that lacked a run."""
        self.seq = 0
        if self._map is not None:
            if self.stale:
                log.warning("tiled cache %s lacks runs of this load: removed, the next load rebuilds it",
                            self.path.name)
                self.path.unlink(missing_ok=True)
            return
        if self._fd is None or self._tmp is None:
            return
        try:
            meta = json.dumps({"version": LAYOUT_VERSION, "source": self.source, "runs": self.index}).encode()
            os.pwrite(self._fd, meta + _FOOTER.pack(MAGIC, self._size, len(meta)), self._size)
            os.close(self._fd)
            self._fd = None
            os.replace(self._tmp, self.path)
            self._tmp = None
        except OSError as e:
            log.warning("tiled cache %s: cannot publish (%s)", self.path.name, e)
            self._abandon()
            return
        prefix = self.path.name.split("-")[1]
        for old in self.path.parent.glob(f"tiled-{prefix}-*.bin"):
            if old != self.path:
                old.unlink(missing_ok=True)
        self._open()

    def _drop_orphans(self) -> None:
        """Remove temporary files of this GGUF left by processes that died while building (a file the size of the
        copy each); a live process's are left alone."""
        for tmp in self.path.parent.glob(f"{self.path.name}.*.tmp"):
            try:
                pid = int(tmp.name[len(self.path.name) + 1:].split(".")[0])
                os.kill(pid, 0)
            except ProcessLookupError:
                tmp.unlink(missing_ok=True)
            except (ValueError, PermissionError, OSError):
                pass

    def _abandon(self) -> None:
        """Stop writing the new file (its maps stay valid while their tensors live; the name goes)."""
        self._off = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
