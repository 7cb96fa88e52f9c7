"""The torch twin of cpu_blockq8.c (int8 activations against GGUF block codes): the oracle of its tests and
the decode path of the torch block backend. Three parts, each checked against the kernel:
  quantize(x)  x [M, K] → codes q per block of 32 (round half to even of x · (top / amax)) and the block
               scales d = amax / top, both exact; top = 127 (x_bits 8) or 32512 (15: the kernel splits each
               code into two int8 planes, an exact rewrite that leaves the integer dots unchanged);
  unpack(w)    W's blocks → unsigned codes u, the format's zero z, weight scales ws per 16 elements and mins
               mn per 32, with ws · (u − z) + mn == block_formats.dequantize(w) bit for bit;
  dots(q, w)   the exact integer Σ (u − z) · q per 16 elements.
matmul() joins them in float64: y = Σ_blocks d · (Σ_halves ws · dot + mn · Σ q). Not a kernel, not a loader.
"""
from __future__ import annotations

import torch

from chatserve_kernels.block_formats import (IQ4_KVALUES, BlockWeight, _bits, _f16, _nibbles,
                                             _scale_min_k4)

BLOCK = 32
ZERO = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "Q6_K": 32, "IQ4_XS": 128, "Q4_1": 0, "Q5_1": 0, "Q4_K": 0,
        "Q5_K": 0}
WITH_MIN = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
FORMATS = tuple(ZERO)


TOP = {8: 127.0, 15: 32512.0}


def quantize(x: torch.Tensor, x_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) → codes int16 [M, K] in [-TOP, TOP], scales float32 [M, K / 32]."""
    m, k = x.shape
    xf = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = xf.abs().amax(-1)                                                      # [M, G]
    top = torch.full_like(amax, TOP[x_bits])  # tensor / tensor: IEEE division (scalar / tensor is 1/x · scalar)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).to(torch.int16).reshape(m, k)
    return q, amax / top


def unpack(w: BlockWeight) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """W [n, k] → u uint8 [n, k], z, ws float32 [n, k / 16], mn float32 [n, k / 32] (zeros without a min)."""
    name, n, k = w.fmt.name, w.n, w.k
    b = w.data.contiguous().reshape(-1, w.fmt.nbytes)
    nb = b.shape[0]
    mn = torch.zeros(nb, w.fmt.block // BLOCK)
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[:, 0:2])                                                        # [nb, 1]
        off = 4 if name in WITH_MIN else 2
        if name in WITH_MIN:
            mn = _f16(b[:, 2:4])
        if name == "Q8_0":
            u = b[:, 2:] ^ 0x80
        elif name.startswith("Q5"):
            u = _nibbles(b[:, off + 4:], 16) | (_bits(b[:, off:off + 4], 32) << 4)
        else:
            u = _nibbles(b[:, off:], 16)
        ws = d.expand(nb, 2)
    elif name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mins = _scale_min_k4(b[:, 4:16])
        ws = (d * sc.float()).repeat_interleave(2, 1)                              # [nb, 16]
        mn = -(dmin * mins.float())                                                # [nb, 8]
        if name == "Q5_K":
            ql = _nibbles(b[:, 48:], 32).reshape(nb, 8, 32)
            qh = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
            u = (ql | (qh << 4)).reshape(nb, 256)
        else:
            u = _nibbles(b[:, 16:], 32)
    elif name == "Q6_K":
        ql = _nibbles(b[:, :128], 64).reshape(nb, 8, 32)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        u = (ql | ((qh & 3).reshape(nb, 8, 32) << 4)).reshape(nb, 256)
        ws = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()      # [nb, 16]
    elif name == "IQ4_XS":
        d = _f16(b[:, 0:2])
        sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        sl = b[:, 4:8]
        lo = torch.stack([sl & 0x0F, sl >> 4], -1).reshape(nb, 8).to(torch.int32)
        hi = (sh >> (2 * torch.arange(8, dtype=torch.int32))) & 3
        ws = (d * ((lo | (hi << 4)) - 32).float()).repeat_interleave(2, 1)
        kvu = (torch.tensor(IQ4_KVALUES, dtype=torch.int16) + 128).to(torch.uint8)
        u = kvu[_nibbles(b[:, 8:], 16).long()]
    else:
        raise ValueError(f"block_q8: format {name} has no integer codes")
    return (u.reshape(n, k).contiguous(), ZERO[name], ws.reshape(n, k // 16).contiguous(),
            mn.reshape(n, k // BLOCK).contiguous())


def dequantize(w: BlockWeight) -> torch.Tensor:
    """ws · (u − z) + mn → W [n, k] float32 (bit-equal to block_formats.dequantize: the unpacking's check)."""
    u, z, ws, mn = unpack(w)
    y = ws.repeat_interleave(16, 1) * (u.to(torch.int16) - z).float()
    return y + mn.repeat_interleave(BLOCK, 1) if w.fmt.name in WITH_MIN else y


def dots(q: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """codes q [M, K] · W's codes → the exact Σ (u − z) · q per 16 elements, int32 [M, N, K / 16]."""
    u, z, _, _ = unpack(w)
    s = (u.to(torch.int64) - z).reshape(w.n, -1, 16)
    return torch.einsum("mhl,nhl->mnh", q.to(torch.int64).reshape(q.shape[0], -1, 16), s).to(torch.int32)


def matmul(x: torch.Tensor, w: BlockWeight, out_dtype: torch.dtype | None = None, x_bits: int = 8) -> torch.Tensor:
    """x [M, K] → x · Wᵀ [M, N] with x quantized as the kernel does, joined in float64, cast to out_dtype."""
    q, d = quantize(x, x_bits)
    _, _, ws, mn = unpack(w)
    i = dots(q, w).double()                                                        # [M, N, K/16]
    dh = d.double().repeat_interleave(2, 1)                                        # [M, K/16]
    y = torch.einsum("mnh,mh,nh->mn", i, dh, ws.double())
    if w.fmt.name in WITH_MIN:
        sq = q.to(torch.float64).reshape(q.shape[0], -1, BLOCK).sum(-1)            # [M, K/32]
        y = y + (d.double() * sq) @ mn.double().t()
    return y.float().to(out_dtype or x.dtype)


def magnitude(x: torch.Tensor, w: BlockWeight, x_bits: int = 8) -> torch.Tensor:
    """Σ over k of the terms' sizes |d·q| · (|ws·(u − z)| + |mn|) [M, N]: the scale of float rounding in y."""
    q, d = quantize(x, x_bits)
    u, z, ws, mn = unpack(w)
    xa = (q.float().abs().reshape(q.shape[0], -1, BLOCK) * d.unsqueeze(-1)).reshape(q.shape)
    wa = ws.abs().repeat_interleave(16, 1) * (u.float() - z).abs() + mn.abs().repeat_interleave(BLOCK, 1)
    return xa.double() @ wa.double().t()


TILED_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


def _tile_k(w: BlockWeight) -> torch.Tensor:
    """Q4_K / Q6_K → the tiled order from the unpacking (u; the file's codes) and the file's scale bytes: per
    (tile, block) 4 chunks of nibbles (byte 64·c + 4·r + i: element 4c + i low, 16 + 4c + i high), Q6_K's high 2
    bits in 2 chunks (chunk h, byte 4·r + i, bits 2c: element 16·h + 4c + i), then (Q6_K) the file's bytes of the
    rows' fp16 d, their int8 sc of elements 0-15 and of 16-31, or (Q4_K) the rows' 6-bit sc, then their 6-bit
    min, a byte each, and after a super-block's 8 blocks the file's bytes of the rows' fp16 d, then of their dmin
    (the kernel forms ws = d · sc and mn = −(dmin · min), unpack's products). [t, nb, 448] (Q6_K) or
    [t, nb / 8, 2368] (Q4_K)."""
    t, nb, bb = (w.n + 15) // 16, w.k // BLOCK, w.fmt.nbytes
    u, _, _, _ = unpack(w)
    up = torch.zeros(t * 16, w.k, dtype=torch.uint8)
    up[:w.n] = u
    b = torch.zeros(t * 16, w.k // 256, bb, dtype=torch.uint8)                   # the file's super-blocks
    b[:w.n] = w.data.reshape(w.n, -1, bb)
    u5 = up.reshape(t, 16, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)           # [t, nb, half, chunk c, row, i]
    nib = (u5[:, :, 0] & 15) | ((u5[:, :, 1] & 15) << 4)                    # [t, nb, c, 16, 4]
    parts = [nib.reshape(t, nb, 256)]
    if w.fmt.name == "Q6_K":
        sh = (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 1, 4, 1, 1)
        hb = (((u5 >> 4) & 3) << sh).sum(3, dtype=torch.uint8)                # [t, nb, half, 16, 4]
        d = b[:, :, 208:210].repeat_interleave(8, 1).reshape(t, 16, nb, 2).transpose(1, 2)          # [t, nb, 16, 2]
        sc = b[:, :, 192:208].reshape(t, 16, nb, 2).permute(0, 2, 3, 1)                            # [t, nb, half, 16]
        parts += [hb.reshape(t, nb, 128), d.reshape(t, nb, 32), sc.reshape(t, nb, 32)]
        return torch.cat(parts, -1).contiguous()
    sc, mn = _scale_min_k4(b[..., 4:16].reshape(-1, 12))                        # [t·16·nb/8, 8]
    parts += [x.reshape(t, 16, nb).transpose(1, 2) for x in (sc, mn)]            # [t, nb, 16]
    blocks = torch.cat(parts, -1).reshape(t, nb // 8, 8 * 288)
    dm = b[..., 0:4].reshape(t, 16, nb // 8, 2, 2).permute(0, 2, 3, 1, 4)         # [t, nb / 8, d | dmin, 16, 2]
    return torch.cat([blocks, dm.reshape(t, nb // 8, 64)], -1).contiguous()


def tile(w: BlockWeight) -> torch.Tensor:
    """W's blocks in cpu_blockq8's tiled order (the layout's check): uint8 [ceil(n / 16), k / 32, bytes],
    per (tile, block) the 16 rows' codes in 4-byte groups (byte 64·c + 4·r + i = row r's code byte 4c + i),
    then their d, then (Q4_1) their m; the K-quants as _tile_k lays them (Q4_K per super-block of 256)."""
    name, nbytes = w.fmt.name, w.fmt.nbytes
    assert name in TILED_FORMATS
    if name in ("Q4_K", "Q6_K"):
        return _tile_k(w)
    t, nb = (w.n + 15) // 16, w.k // BLOCK
    b = torch.zeros(t * 16, nb, nbytes, dtype=torch.uint8)
    b[:w.n] = w.data.reshape(w.n, nb, nbytes)
    b = b.reshape(t, 16, nb, nbytes).transpose(1, 2)                              # [t, nb, 16 rows, nbytes]
    hdr = 4 if name == "Q4_1" else 2
    codes = b[..., hdr:].reshape(t, nb, 16, -1, 4).transpose(2, 3)                # [t, nb, chunks, 16, 4]
    parts = [codes.reshape(t, nb, -1), b[..., 0:2].reshape(t, nb, 32)]
    if name == "Q4_1":
        parts.append(b[..., 2:4].reshape(t, nb, 32))
    return torch.cat(parts, -1).contiguous()


def unpack_tiled(data: torch.Tensor, name: str, n: int, k: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """unpack() read from a tiled copy (data: uint8 of tile(w)'s bytes, any shape) instead of the file: the same u,
    z, ws and mn for W's n rows (the padding rows of the last tile dropped): what prompt rows dequantize from
    when they read the decode rows' copy (cpu_blockmm's tiled source)."""
    assert name in TILED_FORMATS
    t, nb = (n + 15) // 16, k // BLOCK
    if name == "Q4_K":                               # per super-block: 8 blocks of 288 bytes, then d and dmin
        s = data.reshape(t, nb // 8, -1)
        b, dm = s[..., :8 * 288].reshape(t, nb, 288), s[..., 8 * 288:]
    else:
        b = data.reshape(t, nb, -1)

    def rows(x: torch.Tensor) -> torch.Tensor:       # [t, blocks, 16, ...] → [n, blocks, ...]
        x = x.transpose(1, 2)
        return x.reshape(t * 16, *x.shape[2:])[:n]

    chunks = 8 if name == "Q8_0" else 4
    codes = rows(b[..., :64 * chunks].reshape(t, nb, chunks, 16, 4).transpose(2, 3)).reshape(n, nb, 4 * chunks)
    mn = torch.zeros(n, nb)
    if name == "Q8_0":
        u = codes ^ 0x80
    else:
        u = torch.cat([codes & 15, codes >> 4], -1)                                   # [n, nb, 32]
        if name == "Q6_K":
            hb = rows(b[..., 256:384].reshape(t, nb, 2, 16, 4).transpose(2, 3))        # [n, nb, half, 4]
            sh = (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 1, 4, 1)
            u = u | ((((hb.unsqueeze(3) >> sh) & 3).reshape(n, nb, 32)) << 4)
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        at = 64 * chunks
        ws = _f16(rows(b[..., at:at + 32].reshape(t, nb, 16, 2))).expand(n, nb, 2)
        if name == "Q4_1":
            mn = _f16(rows(b[..., at + 32:at + 64].reshape(t, nb, 16, 2))).reshape(n, nb)
    elif name == "Q4_K":                             # unpack's d · sc and −(dmin · min)
        d, dmin = (_f16(rows(dm[..., o:o + 32].reshape(t, nb // 8, 16, 2))).repeat_interleave(8, 1)
                   for o in (0, 32))                                                   # [n, nb, 1]
        sc, mins = (rows(b[..., o:o + 16]).float().unsqueeze(-1) for o in (256, 272))  # [n, nb, 1]
        ws, mn = (d * sc).expand(n, nb, 2), -(dmin * mins)
    else:
        d = _f16(rows(b[..., 384:416].reshape(t, nb, 16, 2)))                          # [n, nb, 1]
        sc = rows(b[..., 416:448].reshape(t, nb, 2, 16).transpose(2, 3)).contiguous().view(torch.int8)
        ws = d * sc.float()                                                             # [n, nb, 2]
    return (u.reshape(n, k).contiguous(), ZERO[name], ws.reshape(n, k // 16).contiguous(),
            mn.reshape(n, nb).contiguous())


def dequantize_tiled(data: torch.Tensor, name: str, n: int, k: int) -> torch.Tensor:
    """A tiled copy → W [n, k] float32, bit-equal to dequantize() of the file's blocks (the twin of cpu_blockmm's
    tiled source)."""
    u, z, ws, mn = unpack_tiled(data, name, n, k)
    y = ws.repeat_interleave(16, 1) * (u.to(torch.int16) - z).float()
    return y + mn.repeat_interleave(BLOCK, 1) if name in WITH_MIN else y


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a · b + c rounded once, as one FMA instruction (the float32 product is exact in float64)."""
    return (a.double() * b.double() + c.double()).float()


def matmul_tiled(x: torch.Tensor, w: BlockWeight, out_dtype: torch.dtype | None = None,
                 x_bits: int = 8) -> torch.Tensor:
    """The arithmetic of cpu_blockq8's tiled kernel, in its order (bit for bit): per x row and W row, over the
    blocks in increasing k, acc = fma(float32(I), ws · d, acc) with I the block's exact Σ (u − z)·q, then
    (with a min) acc = fma(mn, d · float32(Σq), acc). One float epilogue per block, not per lane of 4; Q6_K (a
    scale per 16) two: acc = fma(float32(I₀), ws₀ · d, acc), then the same with the second half's I₁, ws₁."""
    assert w.fmt.name in TILED_FORMATS
    q, d = quantize(x, x_bits)                                                    # [M, K], [M, G]
    _, _, ws, mn = unpack(w)
    i = dots(q, w)                                                                 # [M, N, K/16]
    ib = (i[..., 0::2].to(torch.int64) + i[..., 1::2]).to(torch.int32).float()     # [M, N, G]
    wsb = ws[:, 0::2]                                                              # [N, G]: both halves equal
    sq = q.to(torch.int32).reshape(q.shape[0], -1, BLOCK).sum(-1).float()         # [M, G]
    dsq = d * sq
    acc = torch.zeros(x.shape[0], w.n)
    if w.fmt.name == "Q6_K":
        ih = i.float()                                                             # [M, N, K/16]
        for j in range(w.k // BLOCK):
            for h in range(2):
                acc = _fma32(ih[..., 2 * j + h], ws[:, 2 * j + h].unsqueeze(0) * d[:, j].unsqueeze(1), acc)
        return acc.to(out_dtype or x.dtype)
    for j in range(w.k // BLOCK):
        acc = _fma32(ib[..., j], wsb[:, j].unsqueeze(0) * d[:, j].unsqueeze(1), acc)
        if w.fmt.name in WITH_MIN:
            acc = _fma32(mn[:, j].unsqueeze(0), dsq[:, j].unsqueeze(1), acc)
    return acc.to(out_dtype or x.dtype)
