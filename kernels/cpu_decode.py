"""A decode step's decoder stack on the CPU as one chain of C calls (cpu_ops, cpu_qmatmul or cpu_blockq8's
tiled kernel, cpu_attention) over buffers kept between steps: no torch op or dispatcher work per layer, so a
few-row step costs what its kernels cost. It serves the plain pre-norm SwiGLU layer (Llama, SmolLM2, Mistral
without a window) with matrices packed for cpu_qmatmul (the int4/int8 repack) or a GGUF's own blocks re-laid
for cpu_blockq8's tiled kernel (--gguf-in-place); the model's torch path is its oracle and runs every step
this chain does not take.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chatserve_kernels import cpu_attention, cpu_blockmm, cpu_blockq8, cpu_ops, cpu_qmatmul
from chatserve_kernels.cpu_blockq8 import TiledWeight
from chatserve_kernels.cpu_ops import _DTYPES
from chatserve_kernels.cpu_qmatmul import PackedWeight
from chatserve_kernels.metadata import AttentionMetadata


@dataclass
class TiledBands:
    """W [n, k] as row bands of a GGUF's blocks in cpu_blockq8's tiled layout (q, k and v stay three bands):
    each band writes its column slice of the output. x_bits: the x codes' width (15: two int8 planes)."""
    bands: list[TiledWeight]
    isa: str
    x_bits: int

    @property
    def n(self) -> int:
        return sum(b.n for b in self.bands)

    @property
    def k(self) -> int:
        return self.bands[0].k


ChainMatrix = PackedWeight | TiledBands


@dataclass
class ChainLayer:
    """One layer's weights: norms [H] of the activation dtype, matrices packed for cpu_qmatmul or tiled bands."""
    input_norm: torch.Tensor
    qkv: ChainMatrix           # [(hq + 2·hkv)·d, H]
    o: ChainMatrix             # [H, hq·d]
    ffn_norm: torch.Tensor
    gate_up: ChainMatrix       # [2·I, H]  (gate rows, then up rows)
    down: ChainMatrix          # [H, I]


def usable(dtype: torch.dtype, tiled: bool = False) -> bool:
    """The C libraries are built here (cpu_qmatmul included) and take this activation dtype (tiled: the matrices are
    cpu_blockq8's tiled bands, which take float32 and bfloat16)."""
    probe = torch.empty(0, dtype=dtype)
    mm = dtype in (torch.float32, torch.bfloat16) if tiled else cpu_qmatmul.available()
    return dtype in _DTYPES and mm and cpu_ops.usable(probe) and cpu_attention.available()


class DecodeChain:
    """run(x, positions, meta, caches): the layers over M ≤ max_rows decode tokens, then the final norm."""

    def __init__(self, layers: list[ChainLayer], final_norm: torch.Tensor, eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float, cos: torch.Tensor, sin: torch.Tensor,
                 dtype: torch.dtype, max_rows: int) -> None:
        self.layers, self.final_norm, self.eps = layers, final_norm, float(eps)
        self.hq, self.hkv, self.d, self.scale = heads, kv_heads, head_dim, float(scale)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()                   # [L, d], sign in sin
        self.dtype, self.max_rows = dtype, max_rows
        self.hidden = final_norm.shape[0]
        self.inter = layers[0].down.k
        self._bufs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._ops = cpu_ops.library()
        tiled = [m for ly in layers for m in (ly.qkv, ly.o, ly.gate_up, ly.down) if isinstance(m, TiledBands)]
        self._qmm = cpu_qmatmul.library().chatserve_qmm if len(tiled) < 4 * len(layers) else None
        self._bq8 = cpu_blockq8.library(tiled[0].isa).chatserve_bq8_tiled if tiled else None
        self._attn = cpu_attention.c_paged_attention()

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """This step is one the chain runs: 1..max_rows rows, each a 1-token sequence, every slot valid.
        The caller checked once that the caches are ones cpu_attention takes (its cpu-c attention backend)."""
        M = x.shape[0]
        return 0 < M <= self.max_rows and meta.is_decode_only and x.dtype == self.dtype and meta.all_slots_valid

    def _buffers(self, M: int) -> tuple[torch.Tensor, ...]:
        if M not in self._bufs:
            qkv_n = (self.hq + 2 * self.hkv) * self.d
            e = lambda n: torch.empty(M, n, dtype=self.dtype)                     # noqa: E731
            # xn [M, H], qkv [M, qkv_n], attn [M, hq·d], o [M, H], gu [M, 2I], act [M, I], mlp [M, H]
            self._bufs[M] = (e(self.hidden), e(qkv_n), e(self.hq * self.d), e(self.hidden),
                             e(2 * self.inter), e(self.inter), e(self.hidden))
        return self._bufs[M]

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """x: [M, H] embeddings (used as the residual stream, in place) → final-normed hidden [M, H]."""
        M = x.shape[0]
        x = x.contiguous()
        xn, qkv, attn, o, gu, act, mlp = self._buffers(M)
        dt, bf16, nt = _DTYPES[self.dtype], int(self.dtype == torch.bfloat16), torch.get_num_threads()
        hq, hkv, d, H = self.hq, self.hkv, self.d, self.hidden
        esz = x.element_size()
        qkv_n = (hq + 2 * hkv) * d
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else \
            positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        px, pxn, pqkv, patt, po, pgu, pact, pmlp = (t.data_ptr() for t in (x, xn, qkv, attn, o, gu, act, mlp))
        ppos, pslots, ptab, pqsl, plens = (t.data_ptr() for t in (pos, slots, tables, qsl, lens))
        pcos, psin = self.cos.data_ptr(), self.sin.data_ptr()
        norm, rope, silu_mul, store = (self._ops.chatserve_add_rms_norm, self._ops.chatserve_rope,
                                       self._ops.chatserve_silu_mul, self._ops.chatserve_store_rows)
        qmm, attend, eps = (self._qmm, self._bq8), self._attn, self.eps
        bs = caches[0][0].shape[1]
        row_bytes = hkv * d * esz
        for i, (ly, cache) in enumerate(zip(self.layers, caches)):
            kc, vc = cache
            norm(dt, px, None if i == 0 else pmlp, ly.input_norm.data_ptr(), pxn, M, H, eps, nt)
            _mm(qmm, ly.qkv, pxn, M, pqkv, bf16, nt)
            rope(dt, pqkv, qkv_n, pcos, psin, ppos, M, hq + hkv, d, nt)
            store(pqkv + hq * d * esz, pqkv + (hq + hkv) * d * esz, qkv_n * esz, kc.data_ptr(), vc.data_ptr(),
                  pslots, M, row_bytes)
            rc = attend(dt, pqkv, qkv_n, d, kc.data_ptr(), vc.data_ptr(), kc.stride(0), ptab, tables.stride(0),
                        pqsl, plens, M, hq, hkv, d, bs, self.scale, 0, 0.0, None, patt, hq * d, d, nt)
            if rc:
                raise RuntimeError(f"cpu paged attention failed ({rc})")
            _mm(qmm, ly.o, patt, M, po, bf16, nt)
            norm(dt, px, po, ly.ffn_norm.data_ptr(), pxn, M, H, eps, nt)
            _mm(qmm, ly.gate_up, pxn, M, pgu, bf16, nt)
            silu_mul(dt, pgu, pact, M, self.inter, nt)
            _mm(qmm, ly.down, pact, M, pmlp, bf16, nt)
        out = torch.empty(M, H, dtype=self.dtype)
        norm(dt, px, pmlp, self.final_norm.data_ptr(), out.data_ptr(), M, H, eps, nt)
        return out


def _mm(qmm: tuple, w: ChainMatrix, x_ptr: int, M: int, y_ptr: int, bf16: int, nt: int) -> None:
    """y [M, w.n] = x [M, w.k] · wᵀ (x and y in the chain's dtype): one cpu_qmatmul call, or one cpu_blockq8
    tiled call per band into its column slice."""
    if isinstance(w, PackedWeight):
        codes, scale_lo = w.ptrs
        if qmm[0](codes, scale_lo, w.bits, w.n, w.k, x_ptr, M, y_ptr, bf16, nt):
            raise MemoryError("cpu_qmatmul: scratch allocation failed")
        return
    n, col, esz = w.n, 0, 2 if bf16 else 4
    for b in w.bands:
        threads = cpu_blockmm.threads_for(nt, M * b.n * b.k)
        rc = qmm[1](b.fmt.type_id, b.data.data_ptr(), b.n, b.k, x_ptr, M, bf16, w.x_bits, y_ptr + col * esz, n,
                    bf16, threads)
        if rc:
            raise (MemoryError if rc == 2 else ValueError)(f"cpu_blockq8 tiled failed ({rc}) on {b.fmt.name}")
        col += b.n
