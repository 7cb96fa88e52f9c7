"""A MoE layer's routed experts for decode rows in one C call on experts kept in their GGUF block format in
place (cpu_moe_block.c, issue 32): every selected expert's gate_up, SiLU·up and down through cpu_blockq8's
per-lane kernel over the expert's views of the mapped file (or its tiled kernel over the experts' tiled decode
copies, where the model made them), and the rank-order combine, with the expert ids
and routing weights as arguments. `reference` is the plain-torch twin (block_q8's matmul, torch's SiLU·up and
combine); the model's layer loop (models/moe.py over linear_backends.CpuBlockLinear) gives the same bits as
the C call. Not the router (models/moe.py routes), not the shared expert (the model adds it), and not the
packed int4/int8 experts of the repack path (cpu_moe.py).
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from chatserve_kernels import block_q8, cpu_blockmm, cpu_blockq8, cpu_build, cpu_moe, cpu_ops
from chatserve_kernels.block_formats import BlockWeight

SOURCE = Path(__file__).with_name("cpu_moe_block.c")
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _source(isa: str) -> Path:
    """cpu_blockq8's level source (prelude, block_bytes.h, cpu_blockq8.c), moe_rows.h, then cpu_moe_block.c as
    one source (this file calls chatserve_bq8 of that level), written once into the kernel cache under a name
    of its content, so an edit to any part rebuilds it."""
    level = cpu_blockq8._PRELUDE[isa] + cpu_blockmm.HELPERS.read_text() + cpu_blockq8.SOURCE.read_text()
    return cpu_build.composed_source(f"cpu_moe_block_{isa}",
                                     level + "\n" + cpu_moe.ROWS.read_text() + "\n" + SOURCE.read_text())


@functools.lru_cache(maxsize=None)
def library(isa: str):
    """The compiled MoE call of one cpu_blockq8 level (ctypes), or None where that level or cpu_ops cannot run
    (the CPU lacks it, no compiler): the call runs cpu_ops' SiLU·mul through a pointer to it."""
    if not cpu_blockq8.available(isa) or cpu_ops.library() is None:
        return None
    lib = cpu_build.load(_source(isa))
    if lib is None or lib.chatserve_moe_block_level() != cpu_blockq8.library(isa).chatserve_bq8_level():
        return None
    lib.chatserve_moe_block.argtypes = [_vp, _i64, _vp, _i64, _i64, _i64, _i64, _vp, _i64, _i64, _vp, _vp, _vp,
                                        _i32, _i32, _i32, _i64, _vp]
    lib.chatserve_moe_block.restype = _i32
    return lib


def available(isa: str) -> bool:
    return library(isa) is not None


Band = BlockWeight | cpu_blockq8.TiledWeight


def _table(bands: Sequence[Sequence[Band]]) -> torch.Tensor:
    """[E, B, 4] int64: (GGUF type id, data pointer, row bytes, rows) per expert and band; row bytes 0 for a
    band in the tiled layout (cpu_moe_block.c runs it through chatserve_bq8_tiled)."""
    return torch.tensor([[[b.fmt.type_id, b.data.data_ptr(),
                           0 if isinstance(b, cpu_blockq8.TiledWeight) else b.row_bytes, b.n] for b in e]
                         for e in bands], dtype=torch.int64)


class BlockExperts:
    """E experts' SwiGLU weights as GGUF block bands for the C call: gate_up [2I, H] (its bands: the gate rows,
    then the up rows) and down [H, I] per expert, every band of a cpu_blockq8 format, the same band shapes and
    formats in every expert; the pointer tables are built once (the file's map never moves; the bands are held
    here so it stays mapped). x_bits: the activation codes the loop's band_q8 calls use (8 or 15).
    calls: what the C call runs instead of the file's bands, per expert (gate_up's, down's): the experts'
    CpuBlockLinear decode calls, runs of adjacent bands in the tiled layout (a TiledWeight, gate and up as one)
    and any untiled band as it is; None: the file's bands (the per-lane kernel). A tiled run gives each column
    the bits of block_q8.matmul_tiled over its file band (the twin, `reference`)."""

    def __init__(self, gate_up: list[list[BlockWeight]], down: list[list[BlockWeight]], isa: str,
                 x_bits: int, calls: tuple[list[list[Band]], list[list[Band]]] | None = None) -> None:
        assert len(gate_up) == len(down) > 0 and x_bits in (8, 15)
        self.gate_up, self.down, self.isa, self.x_bits = gate_up, down, isa, x_bits
        self.hidden, self.inter = gate_up[0][0].k, down[0][0].k
        for gu, d in zip(gate_up, down):
            assert [(b.fmt.name, b.n) for b in gu] == [(b.fmt.name, b.n) for b in gate_up[0]]
            assert [(b.fmt.name, b.n) for b in d] == [(b.fmt.name, b.n) for b in down[0]]
            assert sum(b.n for b in gu) == 2 * self.inter and sum(b.n for b in d) == self.hidden
            assert all(b.k == self.hidden for b in gu) and all(b.k == self.inter for b in d)
            assert all(cpu_blockq8.handles(b) and b.data.is_contiguous() for b in gu + d)
        self.calls = calls                      # held: the tables point into the tiled copies
        if calls is not None:
            for c, bands in zip(calls, (gate_up, down)):
                assert len(c) == len(bands)
                assert all(sum(w.n for w in ce) == sum(b.n for b in be) for ce, be in zip(c, bands))
                assert all(len(ce) == len(c[0]) for ce in c)
        self.tiled = calls is not None and any(isinstance(w, cpu_blockq8.TiledWeight) for c in calls
                                               for ce in c for w in ce)
        self.gu_table, self.dn_table = _table(calls[0] if calls else gate_up), _table(calls[1] if calls else down)

    def __len__(self) -> int:
        return len(self.gate_up)


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: BlockExperts,
        threads: int | None = None) -> torch.Tensor:
    """x [T, H] fp32/bf16, ids [T, k] int64, weights [T, k] (x's dtype) → Σ_j weights[:, j] ·
    expert_{ids[:, j]}(x) [T, H] in x's dtype, combined in rank order j = 0, 1, …"""
    x, ids, w, out = cpu_moe.call_args(x, ids, weights, experts.hidden)
    T, H = x.shape
    rc = library(experts.isa).chatserve_moe_block(
        experts.gu_table.data_ptr(), experts.gu_table.shape[1], experts.dn_table.data_ptr(),
        experts.dn_table.shape[1], H, experts.inter, len(experts), x.data_ptr(), T, ids.shape[1], ids.data_ptr(),
        w.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16), experts.x_bits,
        threads or torch.get_num_threads(), cpu_blockmm.ONE_THREAD_MACS, cpu_ops.silu_mul_address())
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(f"cpu_moe_block failed ({rc})")
    return out


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: BlockExperts) -> torch.Tensor:
    """The plain-torch twin, row by row and rank by rank: block_q8.matmul (the block kernel's twin, which joins
    the exact integer dots in float64) for every band, torch's SiLU·up and the rank-order combine in x's dtype.
    It differs from the C call by the order of the float sums in the matmuls (and roundings that follow).
    Tiled experts (experts.tiled): block_q8.matmul_tiled for every band of a tiled format, the tiled kernel's
    own order (bit for bit, so then only the SiLU and the combine can differ)."""
    def matmul(v: torch.Tensor, p: BlockWeight) -> torch.Tensor:
        if experts.tiled and p.fmt.name in cpu_blockq8.TILED_FORMATS:
            return block_q8.matmul_tiled(v, p, torch.float32, experts.x_bits)
        return block_q8.matmul(v, p, torch.float32, experts.x_bits)

    def bands(v: torch.Tensor, parts: list[BlockWeight]) -> torch.Tensor:
        return torch.cat([matmul(v, p) for p in parts], 1).to(v.dtype)

    out = x.new_empty(x.shape)
    for t in range(x.shape[0]):
        acc = None
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = bands(x[t:t + 1], experts.gate_up[e]).chunk(2, -1)
            y = bands(torch.nn.functional.silu(g) * u, experts.down[e]) * weights[t:t + 1, j:j + 1]
            acc = y if acc is None else acc + y
        assert acc is not None
        out[t] = acc[0]
    return out
