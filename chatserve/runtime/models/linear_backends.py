"""The LinearBackend seam for matrices kept in their GGUF block format (issue 29 item 1, issue 30): a
`BlockMatrix` (row bands of raw blocks, views of the memory-mapped file) and the backends that multiply by
one, chosen once at load from the device, the dtype and the CPU's instruction set, never per call.

A backend is one class with `usable(device, isa)` and one line in BLOCK_BACKENDS. The torch twin
(`TorchBlockLinear`: gguf-py's dequantization repeated in torch, then a float32 matmul) is its own backend:
the oracle of the tests and the fallback where no kernel runs. Every backend has the call surface of
layers.Linear (`__call__`, `float_out`, `bytes_read`, `b`, `qw`, `small_m`), so the model holds either.
Not the dense path (layers.Linear) and not a loader (weights.py builds BlockMatrix).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from chatserve_kernels import block_formats, cpu_blockmm
from chatserve_kernels.block_formats import BlockWeight

log = logging.getLogger(__name__)
CPU_ISAS = ("auto", "avx512", "avx2", "torch")


@dataclass
class BlockMatrix:
    """W [n, k] as row bands of GGUF blocks (q, k and v stay three tensors of the file; fused, they are
    three bands), each band in its own format."""
    parts: list[BlockWeight]

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
        return BlockMatrix([p for m in mats for p in m.parts])
    if any(isinstance(m, BlockMatrix) for m in mats):
        raise ValueError("cannot fuse a block-format matrix with a dense one")
    return torch.cat(mats)


class BlockLinear:
    """y = x Wᵀ + b for a BlockMatrix. Subclasses say how one band is multiplied."""

    name: ClassVar[str] = ""
    qw = None          # not a cpu_qmatmul weight: the C decode chain leaves these models to the layer loop
    small_m = 16

    def __init__(self, w: BlockMatrix, b: torch.Tensor | None = None) -> None:
        self.w, self.b = w, b
        self.n, self.k = w.n, w.k

    @classmethod
    def usable(cls, device: torch.device, isa: str) -> bool:
        raise NotImplementedError

    def band(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        """out [M, part.n] (a column slice of y) = x · partᵀ."""
        raise NotImplementedError

    def _run(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        # x: [T, K] → [T, N]
        xa = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype if out_dtype == torch.bfloat16 else torch.float32)
        col = 0
        for part in self.w.parts:
            self.band(xa, part, y[:, col:col + part.n])
            col += part.n
        y = y if self.b is None else y + self.b
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def __call__(self, x: torch.Tensor, rows: object = None) -> torch.Tensor:
        """rows (layers.RowSplit) is accepted and ignored: one arithmetic serves every row, prompt or
        generated, so no row needs routing to stay batch invariant."""
        return self._run(x, x.dtype)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b in float32, never rounded through bf16 (the LM head's logits)."""
        return self._run(x, torch.float32)

    def bytes_read(self, rows: int) -> int:
        bias = 0 if self.b is None else self.b.numel() * self.b.element_size()
        return self.w.nbytes() + bias


class CpuBlockLinear(BlockLinear):
    isa: ClassVar[str] = ""

    @classmethod
    def usable(cls, device: torch.device, isa: str) -> bool:
        return device.type == "cpu" and isa in ("auto", cls.isa) and cpu_blockmm.available(cls.isa)

    def band(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        cpu_blockmm.matmul(x, part, self.isa, out=out)


class CpuAvx512BlockLinear(CpuBlockLinear):
    name, isa = "cpu-avx512", "avx512"


class CpuAvx2BlockLinear(CpuBlockLinear):
    name, isa = "cpu-avx2", "avx2"


class TorchBlockLinear(BlockLinear):
    """The twin: each call dequantizes the bands (gguf-py's arithmetic) and runs a float32 matmul. Slow,
    keeps no dense copy; the tests' oracle and the path where no kernel runs (CUDA, other CPUs)."""

    name = "torch"

    @classmethod
    def usable(cls, device: torch.device, isa: str) -> bool:
        return True

    def band(self, x: torch.Tensor, part: BlockWeight, out: torch.Tensor) -> None:
        w = block_formats.dequantize(part).to(x.device)
        out.copy_(x.float() @ w.t())


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
