"""GGUF weight formats as torch sees them: the table of block formats (GGML type id, elements and bytes per
block), `BlockWeight` (a matrix kept as its file's raw blocks, e.g. a view of the memory-mapped file) and the
plain-torch dequantizer of each format, the oracle of cpu_blockmm.c.

The dequantizers repeat gguf-py's `gguf.quants.dequantize` operation for operation in float32 (same
products, same order, no fused multiply-add), so their results are bit-identical to it (tested). Layouts,
per block (little-endian; d, m, dmin are fp16):
  Q4_0  32 elems, 18 B: d, qs[16]; elem j = lo nibble of qs[j] − 8, elem 16+j = hi nibble − 8; w = d·q
  Q4_1  32, 20 B: d, m, qs[16]; as Q4_0 without the −8; w = d·q + m
  Q5_0  32, 22 B: d, qh (u32), qs[16]; 5th bit of elem i is bit i of qh; q − 16; w = d·q
  Q5_1  32, 24 B: d, m, qh, qs[16]; w = d·q + m
  Q8_0  32, 34 B: d, qs[32] int8; w = q·d
  Q4_K  256, 144 B: d, dmin, scales[12] (8 six-bit scales and mins), qs[128]; 32 bytes of qs hold sub-blocks
        2i (lo nibbles) and 2i+1 (hi); w = (d·sc)·q − dmin·mn
  Q5_K  256, 176 B: as Q4_K plus qh[32] before qs: 5th bit of sub-block j's elem l is bit j of qh[l]
  Q6_K  256, 210 B: ql[128], qh[64], scales[16] int8, d; 16 sub-blocks of 16; w = (d·sc)·(q − 32)
  IQ4_XS 256, 136 B: d, scales_h (u16), scales_l[4], qs[128]; 6-bit scales − 32; w = (d·sc)·kvalues[q]
  F32, F16, BF16: one element per "block".
Not a loader (chatserve/runtime/weights.py) and not a kernel (cpu_blockmm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    type_id: int       # GGMLQuantizationType value (the C kernel's format code)
    block: int         # elements per block
    nbytes: int        # bytes per block


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("F32", 0, 1, 4), BlockFormat("F16", 1, 1, 2), BlockFormat("BF16", 30, 1, 2),
    BlockFormat("Q4_0", 2, 32, 18), BlockFormat("Q4_1", 3, 32, 20), BlockFormat("Q5_0", 6, 32, 22),
    BlockFormat("Q5_1", 7, 32, 24), BlockFormat("Q8_0", 8, 32, 34), BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176), BlockFormat("Q6_K", 14, 256, 210), BlockFormat("IQ4_XS", 23, 256, 136),
)}
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass
class BlockWeight:
    """W [n, k] as raw GGUF blocks: data is uint8 [n, k / block · nbytes] (row r = W's row r)."""
    data: torch.Tensor
    fmt: BlockFormat
    n: int
    k: int

    def __post_init__(self) -> None:
        self._check(self.data)

    def _check(self, data: torch.Tensor) -> None:
        if self.k % self.fmt.block:
            raise ValueError(f"{self.fmt.name} needs K to be a multiple of {self.fmt.block}, got {self.k}")
        row = self.row_bytes
        if data.dtype != torch.uint8 or tuple(data.shape) != (self.n, row):
            raise ValueError(f"{self.fmt.name} [{self.n}, {self.k}] needs uint8 [{self.n}, {row}], "
                             f"got {data.dtype} {list(data.shape)}")

    @property
    def row_bytes(self) -> int:
        return self.k // self.fmt.block * self.fmt.nbytes

    def nbytes(self) -> int:
        return self.n * self.row_bytes

    def row(self, r: int) -> torch.Tensor:
        """Row r's blocks, uint8 [row_bytes]."""
        return self.data[r]

    def source(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the blocks W's rows are read from, their order: None where row r is the source's row r)."""
        return self.data, None

    def release(self) -> None:
        """Drop any copy this weight made of its source (a no-op here: data is the source)."""


class RowOrderedWeight(BlockWeight):
    """W [n, k] whose row r is source's row order[r] (a GGUF's Q/K rows read back in HF order). `data` copies the
    rows on first read and keeps them until release(); row(), nbytes() and the shape read the source, so a band
    whose tiled copy comes mapped from the cache file never makes the copy (0.37 GiB of an 8B model's load)."""

    def __init__(self, source: torch.Tensor, order: torch.Tensor, fmt: BlockFormat, n: int, k: int) -> None:
        # source: uint8 [n, row bytes] (a view of the file's map), order: int64 [n]
        self.fmt, self.n, self.k = fmt, n, k
        self._check(source)
        self._source, self._order = source, order
        self._copy: torch.Tensor | None = None

    @property
    def data(self) -> torch.Tensor:                   # the dataclass field, read through a copy made on demand
        if self._copy is None:
            self._copy = self._source.index_select(0, self._order)
        return self._copy

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        raise AttributeError("a RowOrderedWeight's rows come from its source")

    def row(self, r: int) -> torch.Tensor:
        return self._source[int(self._order[r])]

    def source(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._source, self._order

    def release(self) -> None:
        self._copy = None

    def __repr__(self) -> str:
        return f"RowOrderedWeight({self.fmt.name}, n={self.n}, k={self.k})"


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] → float32 [..., 1] (fp16 widening is exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [nb, c·group] → [nb, c·2·group]: per chunk of `group` bytes, the lo nibbles then the hi ones."""
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], 2).reshape(qs.shape[0], -1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [nb, bytes] → uint8 [nb, bytes·8]: bit i of the little-endian bit string at index i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], -1)[:, :count]


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: scales uint8 [nb, 12] → 6-bit scales and mins [nb, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], 1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], 1)
    return sc, mn


def _dq_legacy(b: torch.Tensor, name: str) -> torch.Tensor:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks uint8 [nb, bytes] → float32 [nb, 32]."""
    d = _f16(b[:, 0:2])
    if name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * d
    has_min = name in ("Q4_1", "Q5_1")
    m = _f16(b[:, 2:4]) if has_min else None
    off = 4 if has_min else 2
    if name.startswith("Q5"):
        q = _nibbles(b[:, off + 4:], 16) | (_bits(b[:, off:off + 4], 32) << 4)
        offset = 16
    else:
        q = _nibbles(b[:, off:], 16)
        offset = 8
    if m is not None:
        return d * q.float() + m
    return d * (q.to(torch.int16) - offset).float()


def _dq_k(b: torch.Tensor, name: str) -> torch.Tensor:
    """Q4_K/Q5_K blocks → float32 [nb, 256]."""
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    ds = (d * sc.float()).reshape(nb, 8, 1)
    dm = (dmin * mn.float()).reshape(nb, 8, 1)
    if name == "Q5_K":
        ql = _nibbles(b[:, 48:], 32).reshape(nb, 8, 32)
        qh = ((b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1)
        q = ql | (qh << 4)
    else:
        q = _nibbles(b[:, 16:], 32).reshape(nb, 8, 32)
    return (ds * q.float() - dm).reshape(nb, 256)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 3).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(nb, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(nb, 16, 1)
    return (d * q).reshape(nb, 256)


def _dq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = _f16(b[:, 0:2])
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF                    # [nb, 1]
    sl = b[:, 4:8]
    lo = torch.stack([sl & 0x0F, sl >> 4], -1).reshape(nb, 8).to(torch.int32)
    hi = (sh >> (2 * torch.arange(8, dtype=torch.int32))) & 3
    dl = (d * ((lo | (hi << 4)) - 32).float()).reshape(nb, 8, 1)
    q = _nibbles(b[:, 8:], 16).reshape(nb, 8, 32).long()
    return (dl * torch.tensor(IQ4_KVALUES, dtype=torch.float32)[q]).reshape(nb, 256)


def dequantize(w: BlockWeight) -> torch.Tensor:
    """The torch twin: W [n, k] float32, bit-identical to gguf-py's dequantize of the same bytes."""
    name = w.fmt.name
    raw = w.data.contiguous()
    if name == "F32":
        return raw.view(torch.float32).clone()
    if name == "F16":
        return raw.view(torch.float16).float()
    if name == "BF16":
        return raw.view(torch.bfloat16).float()
    b = raw.reshape(-1, w.fmt.nbytes)
    if name in ("Q4_K", "Q5_K"):
        out = _dq_k(b, name)
    elif name == "Q6_K":
        out = _dq_q6_k(b)
    elif name == "IQ4_XS":
        out = _dq_iq4_xs(b)
    else:
        out = _dq_legacy(b, name)
    return out.reshape(w.n, w.k)


# byte offsets of the fp16 scales in a block (d, and the min/dmin where the format has one)
_SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
             "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def random_weight(name: str, n: int, k: int, seed: int = 0, scale: float = 0.02) -> BlockWeight:
    """W [n, k] of format `name` from random bytes (every code pattern) with finite fp16 scales of about
    `scale` (dmin-like ones positive): test and benchmark data for formats gguf-py cannot quantize."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    if fmt.block == 1:
        vals = torch.randn(n, k, generator=g) * scale
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return BlockWeight(vals.to(dt).view(torch.uint8).reshape(n, -1).contiguous(), fmt, n, k)
    nb = n * k // fmt.block
    raw = torch.randint(0, 256, (nb, fmt.nbytes), generator=g, dtype=torch.uint8)
    for i, at in enumerate(_SCALE_AT[name]):
        s = torch.randn(nb, 1, generator=g) * scale
        raw[:, at:at + 2] = (s.abs() if i else s).half().view(torch.uint8)
    return BlockWeight(raw.reshape(n, -1), fmt, n, k)


def matmul_torch(x: torch.Tensor, w: BlockWeight, out_dtype: torch.dtype | None = None,
                 w_bf16: bool = False) -> torch.Tensor:
    """x [M, K] → x · Wᵀ [M, N] in float32 on the dequantized W, cast to out_dtype (default x's). w_bf16: W
    rounded to bf16 first (cpu_blockmm's AMX arithmetic for bf16 x; its sums differ from this float32
    matmul's only in order, a few ulps of Σ|x||w|)."""
    d = dequantize(w)
    y = x.float() @ (d.bfloat16().float() if w_bf16 else d).t()
    return y.to(out_dtype or x.dtype)
