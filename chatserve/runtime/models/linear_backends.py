"""The LinearBackend seam for matrices kept in their GGUF block format (issue 29 item 1, issue 30): a
`BlockMatrix` (row bands of raw blocks, views of the memory-mapped file) and the backends that multiply by
one, chosen once at load from the device, the dtype and the CPU's instruction set, never per call.

A backend is one class with `usable(device, isa)` and one line in BLOCK_BACKENDS. Each has two arithmetics:
generated-token (decode) rows take int8 activations against the codes (`band_q8`: cpu_blockq8, exact integer
dots; F32/F16/BF16 bands have no codes and stay on the float path), prompt rows the float one (`band`:
cpu_blockmm, the blocks dequantized to fp32); the step's RowSplit sends each row to its kind's arithmetic,
so a row's result never depends on the rows sharing its step (issue 28). The torch twin (`TorchBlockLinear`:
block_formats' and block_q8's torch arithmetic) is its own backend: the oracle of the tests and the fallback
where no kernel runs. Every backend has the call surface of
layers.Linear (`__call__`, `float_out`, `bytes_read`, `b`, `qw`, `small_m`), so the model holds either.
Not the dense path (layers.Linear) and not a loader (weights.py builds BlockMatrix).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import torch

from chatserve_kernels import block_formats, block_q8, cpu_blockmm, cpu_blockq8
from chatserve_kernels.block_formats import BlockWeight
from chatserve_kernels.tiled_store import TiledStore


class RowKinds(Protocol):
    """What this module reads of layers.RowSplit (a protocol: layers imports this module)."""
    @property
    def all_gen(self) -> bool: ...
    @property
    def gen(self) -> torch.Tensor | None: ...
    @property
    def prompt(self) -> torch.Tensor | None: ...



def by_row_kind(x: torch.Tensor, rows: RowKinds, n: int, gen: Callable[[torch.Tensor], torch.Tensor],
                prompt: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, K] → [T, n]: generated rows through `gen`, prompt rows through `prompt` (each kind's own
    arithmetic whatever shares the step: batch invariance), one call when the step has one kind."""
    if rows.all_gen:
        return gen(x)
    if rows.gen is None:
        return prompt(x)
    assert rows.prompt is not None
    y = x.new_empty(x.shape[0], n)
    y[rows.gen] = gen(x[rows.gen])
    y[rows.prompt] = prompt(x[rows.prompt])
    return y


log = logging.getLogger(__name__)
CPU_ISAS = ("auto", "avx512", "avx2", "torch")
# generated rows' x codes per block of 32: 15 bits (two int8 planes, twice the integer dots) keeps the decode
# logits as close to float32 as the int4 path's; 8 bits (one plane) moved them 4.5-6.6 % of their scale on
# the quality test's file (docs/kernels.md, "Quality of int8 x")
DECODE_X_BITS = 15
# generated rows on Q4_0/Q4_1/Q8_0/Q4_K/Q6_K bands (AVX2 and AVX-512 levels) run a row-interleaved copy of the
# band's blocks (cpu_blockq8's tiled kernel: a vector lane per output row, one float epilogue per block and 16
# rows) instead of the file's order (a float epilogue per lane of 4 products); False keeps the file's order
# (benchmarks)
TILED_DECODE = True


@dataclass
class BlockMatrix:
    """W [n, k] as row bands of GGUF blocks (q, k and v stay three tensors of the file; fused, they are
    three bands), each band in its own format. store: where a backend keeps the tiled copies of these bands
    (the model file's TiledStore: a cache file mapped from disk), None: in anonymous memory."""
    parts: list[BlockWeight]
    store: TiledStore | None = None

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def formats(self) -> list[str]:
        return sorted({p.fmt.name for p in self.parts})

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [T] dequantized (bit-equal to gguf-py) → [T, k] in dtype: the embedding lookup."""
        assert len(self.parts) == 1, "row lookup on a fused matrix"
        p = self.parts[0]
        picked = BlockWeight(p.data.index_select(0, ids), p.fmt, int(ids.shape[0]), p.k)
        return block_formats.dequantize(picked).to(dtype)


def cat_rows(mats: list[Any]) -> torch.Tensor | BlockMatrix:
    """Stack matrices by rows: torch.cat for tensors, a band list (no copy) for BlockMatrix."""
    if all(isinstance(m, BlockMatrix) for m in mats):
        return BlockMatrix([p for m in mats for p in m.parts], mats[0].store)
    if any(isinstance(m, BlockMatrix) for m in mats):
        raise ValueError("cannot fuse a block-format matrix with a dense one")
    return torch.cat(mats)


class BlockLinear:
    """y = x Wᵀ + b for a BlockMatrix. Subclasses say how one band is multiplied, for prompt rows (`band`)
    and for generated rows (`band_q8`, int8 activations; bands of a format without codes use `band`)."""

    name: ClassVar[str] = ""
    # --gguf-in-place auto: a GGUF runs on this backend (float32 activations) rather than on dense copies + an int4
    # repack, because its prompt rows and its generated rows are both at least as fast (docs/benchmarks.md)
    in_place_by_default: ClassVar[bool] = False
    qw = None          # not a cpu_qmatmul weight: the C decode chain leaves these models to the layer loop
    small_m = 16

    def __init__(self, w: BlockMatrix, b: torch.Tensor | None = None, tile: bool = False) -> None:
        """tile: a backend that has a re-laid layout for generated rows may build it at load (the dense
        layers and the LM head ask; MoE experts do not, their bytes stay the file's only)."""
        self.w, self.b = w, b
        self.n, self.k = w.n, w.k

    @classmethod
    def usable(cls, device: torch.device, isa: str) -> bool:
        raise NotImplementedError

    def band(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        """out [M, part.n] (a column slice of y) = x · partᵀ, x as given (prompt rows)."""
        raise NotImplementedError

    def band_q8(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        """As band, with x quantized per block of 32 to int8 (generated rows; part has integer codes)."""
        raise NotImplementedError

    def _run(self, x: torch.Tensor, out_dtype: torch.dtype, decode: bool) -> torch.Tensor:
        # x: [T, K] → [T, N]
        xa = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype if out_dtype == torch.bfloat16 else torch.float32)
        col = 0
        for part in self.w.parts:
            if decode and part.fmt.name in cpu_blockq8.FORMATS:
                self.band_q8(xa, part, y[:, col:col + part.n])
            else:
                self.band(xa, part, y[:, col:col + part.n])
            col += part.n
        y = y if self.b is None else y + self.b
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def __call__(self, x: torch.Tensor, rows: RowKinds | None = None) -> torch.Tensor:
        """rows (the step's layers.RowSplit): generated rows take the int8-activation arithmetic and prompt
        rows the float one, whatever else shares the step; rows None picks by step size (≤ small_m rows:
        decode), for benchmarks and kernel tests."""
        # x: [T, K] → [T, N]
        if rows is None:
            return self._run(x, x.dtype, x.shape[0] <= self.small_m)
        return by_row_kind(x, rows, self.n, lambda g: self._run(g, x.dtype, True),
                           lambda p: self._run(p, x.dtype, False))

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b in float32, never rounded through bf16 (the LM head's logits), through the int8-activation
        arithmetic at every row count (batch invariance; the head is the largest matrix a decode step reads)."""
        return self._run(x, torch.float32, True)

    def bytes_read(self, rows: int) -> int:
        bias = 0 if self.b is None else self.b.numel() * self.b.element_size()
        return self.w.nbytes() + bias

    def resident_bytes(self) -> int:
        """Bytes this backend holds beside the mapped file (a re-laid copy of some bands; 0 here)."""
        return 0


class CpuBlockLinear(BlockLinear):
    isa: ClassVar[str] = ""

    @classmethod
    def usable(cls, device: torch.device, isa: str) -> bool:
        return device.type == "cpu" and isa in ("auto", cls.isa) and cpu_blockmm.available(cls.isa)

    def __init__(self, w: BlockMatrix, b: torch.Tensor | None = None, tile: bool = False) -> None:
        super().__init__(w, b, tile)
        # at load: the int8-activation kernel of this level, else the twin's arithmetic (same results)
        self.q8 = cpu_blockq8.available(self.isa)
        # and, where this level has one (AVX2, AVX-512: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), the bands' blocks re-laid
        # row-interleaved for the generated rows (same codes and scales in another order, a copy the size of
        # the band, 1.03 or 1.07 of it for Q4_K / Q6_K whose scales are re-laid: the mapped pages are then
        # read only by prompt rows). The decode rows' calls: runs of adjacent bands of one tiled
        # format (each but the last a whole number of 16-row tiles, so their tiled copies end to end are the
        # tiled copy of the stacked rows: q, k and v in one call, gate and up in one) as (first column, the
        # run's tiled weight), other bands one by one. A run is tiled once into one buffer: a region of the
        # model file's tiled cache (w.store; mapped as it is on a later load) or anonymous memory
        runs: list[tuple[int, list[BlockWeight], bool]] = []       # (first column, bands, tiled)
        col = 0
        for p in w.parts:
            t = tile and self.q8 and TILED_DECODE and cpu_blockq8.tiles(self.isa, p)
            last = runs[-1] if runs else None
            if (t and last is not None and last[2] and last[1][-1].fmt == p.fmt
                    and sum(b.n for b in last[1]) % 16 == 0):
                last[1].append(p)
            else:
                runs.append((col, [p], t))
            col += p.n
        self.decode_calls: list[tuple[int, cpu_blockq8.TiledWeight | BlockWeight]] = [
            (c, self._tiled_run(bands, w.store) if t else bands[0]) for c, bands, t in runs]
        self.tiled = any(t for _, _, t in runs)

    def _tiled_run(self, bands: list[BlockWeight], store: TiledStore | None) -> cpu_blockq8.TiledWeight:
        """Adjacent bands of one format → their tiled copy end to end, in one buffer."""
        sizes = [cpu_blockq8.tiled_nbytes(p) for p in bands]

        def fill(buf: torch.Tensor) -> None:
            at = 0
            for p, size in zip(bands, sizes):
                cpu_blockq8.tile_into(p, buf[at:at + size], self.isa)
                at += size
        if store is not None:
            buf = store.run(bands, sum(sizes), fill)
        else:
            buf = cpu_blockq8.huge_page_buffer(sum(sizes))
            fill(buf)
        for p in bands:            # tiled bands are read through their copy only: drop any row-order copy
            p.release()
        return cpu_blockq8.TiledWeight(buf, bands[0].fmt, sum(p.n for p in bands), bands[0].k)

    def band(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        cpu_blockmm.matmul(x, part, self.isa, out=out)

    def resident_bytes(self) -> int:
        return sum(w.nbytes() for _, w in self.decode_calls if isinstance(w, cpu_blockq8.TiledWeight))

    def _run(self, x: torch.Tensor, out_dtype: torch.dtype, decode: bool) -> torch.Tensor:
        if not self.tiled:                      # no tiled band: the file's order, band by band
            return super()._run(x, out_dtype, decode)
        # x: [T, K] → [T, N]: the decode calls (runs of tiled bands, other bands as BlockLinear._run takes them);
        # prompt rows read the tiled runs too (cpu_blockmm's tiled source: the file's values, the same bits), so
        # the file's pages of tiled bands are never touched after load
        xa = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype if out_dtype == torch.bfloat16 else torch.float32)
        for col, w in self.decode_calls:
            out = y[:, col:col + w.n]
            if isinstance(w, cpu_blockq8.TiledWeight):
                if decode:
                    cpu_blockq8.matmul_tiled(xa, w, self.isa, out=out, x_bits=DECODE_X_BITS)
                else:
                    cpu_blockmm.matmul_tiled(xa, w, self.isa, out=out)
            elif not decode:
                self.band(xa, w, out)
            elif w.fmt.name in cpu_blockq8.FORMATS:
                self.band_q8(xa, w, out)
            else:
                self.band(xa, w, out)
        y = y if self.b is None else y + self.b
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def band_q8(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        if self.q8:
            cpu_blockq8.matmul(x, part, self.isa, out=out, x_bits=DECODE_X_BITS)
        else:
            out.copy_(block_q8.matmul(x, part, torch.float32, DECODE_X_BITS))


class CpuAvx512BlockLinear(CpuBlockLinear):
    name, isa = "cpu-avx512", "avx512"


class CpuAvx2BlockLinear(CpuBlockLinear):
    name, isa = "cpu-avx2", "avx2"
    in_place_by_default = True    # AVX2-only CPUs: the 6×16 prompt-row microkernel and the tiled decode kernel


class TorchBlockLinear(BlockLinear):
    """The twin: prompt rows dequantize the bands (gguf-py's arithmetic) and run a float32 matmul, generated
    rows run block_q8's int8 arithmetic. Slow, keeps no dense copy; the tests' oracle and the path where no
    kernel runs (CUDA, other CPUs)."""

    name = "torch"

    @classmethod
    def usable(cls, device: torch.device, isa: str) -> bool:
        return True

    def band(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        w = block_formats.dequantize(part).to(x.device)
        out.copy_(x.float() @ w.t())

    def band_q8(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        out.copy_(block_q8.matmul(x.cpu(), part, torch.float32, DECODE_X_BITS).to(out.device))


# preference order: a new kernel is one class above and one entry here
BLOCK_BACKENDS: tuple[type[BlockLinear], ...] = (CpuAvx512BlockLinear, CpuAvx2BlockLinear, TorchBlockLinear)


def choose_block_backend(device: torch.device, isa: str = "auto") -> type[BlockLinear]:
    """The backend for block-format matrices on this device and CPU, once per model. isa forces a level
    ("avx2" on an AVX-512 CPU for tests and benchmarks, "torch" for the twin); a level this CPU cannot
    run is an error, not a silent fallback."""
    if isa not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {CPU_ISAS}, got {isa!r}")
    for cls in BLOCK_BACKENDS:
        if isa in ("auto", cls.name.removeprefix("cpu-")) and cls.usable(device, isa):
            return cls
    raise ValueError(f"--cpu-isa {isa}: this CPU or build cannot run it (flags: avx2 "
                     f"{cpu_blockmm.supported('avx2')}, avx512 {cpu_blockmm.supported('avx512')})")
