"""A MoE layer's routed experts for decode rows in one C call (cpu_moe.c, issue 32): every selected expert's
gate_up, SiLU·up and down over cpu_qmatmul's packed 4/8-bit weights, and the rank-order combine, with the
expert ids and routing weights as arguments. `reference` is the plain-torch twin (dequantized weights, float
matmuls); the model's layer loop (models/moe.py over layers.Linear) gives the same bits as the C call.
Not the router (models/moe.py routes) and not the shared expert (the model adds it).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from chatserve_kernels import cpu_build, cpu_ops, cpu_qmatmul
from chatserve_kernels.cpu_qmatmul import PackedWeight

SOURCE = Path(__file__).with_name("cpu_moe.c")
ROWS = Path(__file__).with_name("moe_rows.h")      # shared with cpu_moe_block: loads, stores, the combine
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _source() -> Path:
    """cpu_qmatmul.c, moe_rows.h, then cpu_moe.c as one source (cpu_moe.c calls the tile kernels, which are
    static), written once into the kernel cache under a name of its content, so an edit to any part rebuilds it."""
    return cpu_build.composed_source(
        "cpu_moe", cpu_qmatmul.SOURCE.read_text() + "\n" + ROWS.read_text() + "\n" + SOURCE.read_text())


@functools.lru_cache(maxsize=1)
def library():
    """The compiled MoE call (ctypes), or None where cpu_qmatmul or cpu_ops cannot run (no AVX2, switched off,
    no compiler): the call runs cpu_ops' SiLU·mul through a pointer to it."""
    if not cpu_qmatmul.available() or cpu_ops.library() is None:
        return None
    lib = cpu_build.load(_source())
    if lib is None or lib.chatserve_moe_tile() != cpu_qmatmul.TILE:
        return None
    lib.chatserve_moe.argtypes = [_vp, _vp, _i32, _i64, _i64, _i64, _vp, _i64, _i64, _vp, _vp, _vp, _i32, _i32, _vp]
    lib.chatserve_moe.restype = _i32
    return lib


def available() -> bool:
    return library() is not None


class PackedExperts:
    """E experts' packed SwiGLU weights for the C call: gate_up [2I, H] (gate rows, then up rows) and down
    [H, I] per expert, all of one bit width; the pointer tables are built once (the weights never move)."""

    def __init__(self, gate_up: list[PackedWeight], down: list[PackedWeight]) -> None:
        assert len(gate_up) == len(down) > 0
        self.gate_up, self.down = gate_up, down
        self.bits = gate_up[0].bits
        self.hidden, self.inter = gate_up[0].k, down[0].k
        for gu, d in zip(gate_up, down):
            assert gu.bits == d.bits == self.bits
            assert (gu.n, gu.k, d.n, d.k) == (2 * self.inter, self.hidden, self.hidden, self.inter)
        # [E, 2] int64: (codes, scales+lows) data pointers
        self.gu_ptrs = torch.tensor([list(w.ptrs) for w in gate_up], dtype=torch.int64)
        self.dn_ptrs = torch.tensor([list(w.ptrs) for w in down], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.gate_up)


def call_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, hidden: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both MoE calls (this one and cpu_moe_block's) pass to C: x [T, H] contiguous, ids [T, k] int64,
    the routing weights [T, k] as fp32 (exact from bf16), and out [T, H] in x's dtype."""
    assert x.shape[1] == hidden and x.dtype in (torch.float32, torch.bfloat16) and ids.shape == weights.shape
    return (x.contiguous(), ids.to(torch.int64).contiguous(), weights.float().contiguous(),
            torch.empty(x.shape[0], hidden, dtype=x.dtype))


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: PackedExperts) -> torch.Tensor:
    """x [T, H] fp32/bf16, ids [T, k] int64, weights [T, k] (x's dtype) → Σ_j weights[:, j] ·
    expert_{ids[:, j]}(x) [T, H] in x's dtype, combined in rank order j = 0, 1, …"""
    x, ids, w, out = call_args(x, ids, weights, experts.hidden)
    T, H = x.shape
    rc = library().chatserve_moe(experts.gu_ptrs.data_ptr(), experts.dn_ptrs.data_ptr(), experts.bits, H,
                                 experts.inter, len(experts), x.data_ptr(), T, ids.shape[1], ids.data_ptr(),
                                 w.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16),
                                 torch.get_num_threads(), cpu_ops.silu_mul_address())
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(f"cpu_moe failed ({rc})")
    return out


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              experts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The plain-torch twin: experts as dense (gate_up [2I, H], down [H, I]) float32 weights (e.g.
    cpu_qmatmul.dequantize of the packed codes), float32 matmuls, the rank-order combine; x's dtype out.
    It differs from the C call only by the C call's quantized activations and its roundings to x's dtype."""
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(ids.shape[1]):
        for t in range(x.shape[0]):
            gu, down = experts[int(ids[t, j])]
            g, u = (xf[t] @ gu.t()).chunk(2)                                         # [I] each
            out[t] += weights[t, j].float() * ((torch.nn.functional.silu(g) * u) @ down.t())
    return out.to(x.dtype)
