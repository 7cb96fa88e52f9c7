"""The mixture-of-experts layer: a router picks each row's top-k SwiGLU experts, each selected expert runs
once over all the rows routed to it (its weights read once a step), and each row combines its experts'
outputs in its own rank order (so a row's result never depends on which rows share its experts).
Also how its weights are read, in the three layouts checkpoints use (read_experts).

Not a family (qwen_moe.py, mixtral.py, olmoe.py) and not the config (arch_config.MoESpec).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, Sequence

import torch

from chatserve.runtime.arch_config import MoESpec, UnsupportedModelError
from chatserve.runtime.models.layers import ALL_PROMPT, AnyLinear, FusedCpuOps, GatedMLP, Linear, RowSplit, TorchOps
from chatserve.runtime.models import linear_backends
from chatserve.runtime.models.linear_backends import BlockMatrix, CpuBlockLinear, cat_rows
from chatserve_kernels import block_formats, cpu_blockq8, cpu_moe, cpu_moe_block, env


class WeightReader(Protocol):
    """What reading experts needs of decoder.WeightReader (which imports this module)."""

    dtype: torch.dtype

    def __call__(self, name: str, when: bool = True) -> Any: ...

    def has(self, name: str) -> bool: ...


class MoE:
    """sum_k w_k · expert_{i_k}(x) over the row's top-k experts (+ sigmoid(x·g) · shared(x), Qwen2-MoE).
    Routing: p = softmax(router(x)) in float32, (w, i) = topk(p, k), w /= sum(w) when norm_topk_prob.
    packed (cpu_moe, see packed_experts; cpu_moe_block for experts kept in their GGUF block format, see
    block_experts): the generated rows' routed experts in one C call, the same bits as the expert loop below
    (which prompt rows, and every row without it, take)."""

    def __init__(self, router: Linear, experts: Sequence[GatedMLP], top_k: int, norm_topk_prob: bool,
                 shared: GatedMLP | None = None, shared_gate: Linear | None = None,
                 packed: cpu_moe.PackedExperts | cpu_moe_block.BlockExperts | None = None) -> None:
        self.router, self.experts, self.top_k, self.norm = router, experts, top_k, norm_topk_prob
        self.shared, self.shared_gate, self.packed = shared, shared_gate, packed
        # rows=None (benchmarks, kernel tests): steps of up to small_m rows take the quantized copies
        self.small_m = experts[0].gate_up.small_m

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] → (weights [T, k] in x's dtype, expert ids [T, k] int64), best first."""
        probs = torch.softmax(self.router.float_out(x), dim=-1)             # [T, E] float32
        w, idx = torch.topk(probs, self.top_k, dim=-1)                       # [T, k]
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype), idx

    def __call__(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # x: [T, H] → [T, H]; rows: the step's generated / prompt rows (layers.RowSplit)
        w, idx = self.route(x)
        if self.packed is None or (rows is None and x.shape[0] > self.small_m) \
                or (rows is not None and rows.gen is None and not rows.all_gen):
            out = self._routed(x, w, idx, rows)
        elif rows is None or rows.all_gen:                       # every row generated: one C call
            out = self._packed(x, idx, w)
        else:                                                    # a mixed step: each kind its own way
            assert rows.gen is not None and rows.prompt is not None
            out = x.new_empty(x.shape)
            out[rows.gen] = self._packed(x[rows.gen], idx[rows.gen], w[rows.gen])
            p = rows.prompt
            out[p] = self._routed(x[p], w[p], idx[p], ALL_PROMPT)
        return self._add_shared(out, x, rows)

    def _packed(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The routed experts of generated rows in one C call: x [T, H], idx / w [T, k] → [T, H]."""
        if isinstance(self.packed, cpu_moe_block.BlockExperts):
            return cpu_moe_block.moe(x, idx, w, self.packed)
        assert self.packed is not None
        return cpu_moe.moe(x, idx, w, self.packed)

    def _routed(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, rows: RowSplit | None) -> torch.Tensor:
        """Σ_j w[:, j] · expert_{idx[:, j]}(x) through the experts' own Linears. x: [T, H]; w, idx: [T, k]."""
        T, k = x.shape[0], self.top_k
        if T == 1:                     # one row (a one-stream decode step): its experts in rank order
            return self._combine([self.experts[e](x, rows) for e in idx[0].tolist()], w)
        flat = idx.reshape(-1)                                               # [T·k] slot t·k + j
        order = torch.argsort(flat, stable=True)                             # slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        src = order // k                                                     # [T·k] each slot's row
        xs = x[src]                                                          # [T·k, H] rows by expert
        splits = _group_splits(rows, src, counts, T)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:                                                            # one matmul pass per expert
                ys[start:start + n] = self.experts[e](xs[start:start + n], splits[e])
                start += n
        y = torch.empty_like(ys)
        y[order] = ys
        y = y.view(T, k, -1)                                                 # [T, k, H] by the row's rank
        return self._combine([y[:, j] for j in range(k)], w)

    @staticmethod
    def _combine(ys: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        """Σ_j w[:, j] · ys[j] in rank order j = 0, 1, … (the same arithmetic for a row whatever its
        batch). ys: k of [T, H]; w: [T, k] → [T, H]."""
        out = ys[0] * w[:, :1]
        for j in range(1, len(ys)):
            out = out + ys[j] * w[:, j:j + 1]
        return out

    def _add_shared(self, out: torch.Tensor, x: torch.Tensor, rows: RowSplit | None) -> torch.Tensor:
        """out + sigmoid(x·g) · shared(x) (Qwen2-MoE's gated shared expert), or out. [T, H]."""
        if self.shared is not None:
            assert self.shared_gate is not None
            gate = torch.sigmoid(self.shared_gate(x, rows))                  # [T, 1] (dense)
            out = out + gate * self.shared(x, rows)
        return out

    def bytes_read(self, rows: int) -> int:
        """Weight bytes a step of `rows` rows reads at most: the router, min(E, rows·k) experts (each
        once, over its share of the rows), the shared expert."""
        selected = min(len(self.experts), rows * self.top_k)
        share = -(-rows * self.top_k // selected)                  # rows per selected expert, rounded up
        total = self.router.bytes_read(rows) + sum(e.bytes_read(share) for e in self.experts[:selected])
        if self.shared is not None and self.shared_gate is not None:
            total += self.shared.bytes_read(rows) + self.shared_gate.bytes_read(rows)
        return total


def _group_splits(rows: RowSplit | None, src: torch.Tensor, counts: list[int], T: int) -> list[RowSplit | None]:
    """Each expert's RowSplit over its group of the sorted slots (src: [T·k] the row of each slot): a
    generated row stays on the quantized copy and a prompt row on the dense weight inside every group."""
    if rows is None or rows.gen is None:                 # every row of one kind (or no split): the same
        return [rows] * len(counts)
    gen = torch.zeros(T, dtype=torch.bool, device=src.device)
    gen[rows.gen] = True
    flags = gen[src].tolist()
    out, start = [], 0
    for n in counts:
        out.append(RowSplit.build(flags[start:start + n], src.device) if n else None)
        start += n
    return out


ExpertWeights = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def check_expert_count(name: str, t: torch.Tensor, n: int) -> None:
    """A stacked expert tensor [E, ...] must hold exactly the config's n experts."""
    if t.shape[0] != n:
        raise UnsupportedModelError(f"{name} holds {t.shape[0]} experts, the config {n}")


def read_experts(r: WeightReader, p: str, n: int, names: tuple[str, str, str]) -> ExpertWeights | None:
    """[(gate [I, H], up [I, H], down [H, I])] of n experts under prefix p ("…mlp.experts."), in whichever
    layout the checkpoint has: one tensor each (HF hub: p{e}.{gate}.weight), stacked along a first expert
    axis (GGUF: p{gate}.weight [E, I, H]), or transformers' fused form (p gate_up_proj [E, 2I, H],
    p down_proj [E, H, I]). names: the (gate, up, down) tensor names. None when a tensor is missing
    (r records it)."""
    g, u, d = names
    if r.has(p + "gate_up_proj"):
        gu, down = r(p + "gate_up_proj"), r(p + "down_proj")
        if down is None:
            return None
        check_expert_count(p + "gate_up_proj", gu, n)
        check_expert_count(p + "down_proj", down, n)
        return [(*gu[e].chunk(2, 0), down[e]) for e in range(n)]
    if r.has(p + f"{g}.weight"):
        gs, us, ds = (r(p + f"{t}.weight") for t in names)
        if us is None or ds is None:
            return None
        for t, name in zip((gs, us, ds), names):
            check_expert_count(p + f"{name}.weight", t, n)
        return [(gs[e], us[e], ds[e]) for e in range(n)]
    out = [tuple(r(p + f"{e}.{t}.weight") for t in names) for e in range(n)]
    return None if any(t is None for ws in out for t in ws) else out


def read_moe(r: WeightReader, m: str, spec: MoESpec, lin: Callable[[torch.Tensor | BlockMatrix], AnyLinear], act: str,
             ops: TorchOps, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> MoE | None:
    """The MoE layer under prefix m ("…mlp."): router m gate.weight [E, H], experts under m experts.
    (read_experts), and with spec.shared_expert_size the shared expert m shared_expert.* and its gate
    m shared_expert_gate.weight [1, H] (Qwen2-MoE). None when a tensor is missing (r records it)."""
    router = r(m + "gate.weight")
    experts = read_experts(r, m + "experts.", spec.num_experts, names)
    shared = gate = None
    if spec.shared_expert_size:
        sg, su, sd = (r(m + f"shared_expert.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        gate = r(m + "shared_expert_gate.weight")
        if gate is None or sg is None or su is None or sd is None:
            return None
        shared = (sg, su, sd)
    if router is None or experts is None:
        return None
    return build_moe(experts, router, spec, lin, act, ops, shared, gate, r.dtype)


def build_moe(experts: ExpertWeights, router: torch.Tensor, spec: MoESpec,
              lin: Callable[[torch.Tensor | BlockMatrix], AnyLinear],
              act: str, ops: TorchOps, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              shared_gate: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> MoE:
    """The MoE layer on read weights: gate and up fused per expert, every matrix through lin (a
    layers.Linear, or a block backend for a GGUF matrix kept in place); the router and the shared
    expert's gate dense (their float32 logits decide the routing), in dtype (default: the experts')."""
    dtype = dtype or experts[0][0].dtype
    mlps = [GatedMLP(lin(cat_rows([g, u])), lin(d), act, ops) for g, u, d in experts]
    sh = None if shared is None else GatedMLP(lin(cat_rows(list(shared[:2]))), lin(shared[2]), act, ops)
    return MoE(Linear(dense(router, dtype)), mlps, spec.top_k, spec.norm_topk_prob, sh,
               None if shared_gate is None else Linear(dense(shared_gate, dtype).reshape(1, -1)),
               packed_experts(mlps, act, ops) or block_experts(mlps, act, ops))


def block_experts(mlps: Sequence[GatedMLP], act: str, ops: TorchOps) -> cpu_moe_block.BlockExperts | None:
    """The experts' GGUF block bands (--gguf-in-place) as one cpu_moe_block table, when the C call gives their
    loop's bits: SiLU through cpu_ops (FusedCpuOps), plain GatedMLPs, every gate_up and down a CpuBlockLinear of
    one level running cpu_blockq8's kernels for generated rows (no bias, every band of a cpu_blockq8 format, the
    same band formats and shapes in every expert), and CHATSERVE_MOE_KERNEL not 0. Where the experts have tiled
    decode copies the table points at them (the loop's CpuBlockLinear decode calls: tiled runs through the tiled
    kernel, other bands through the per-lane one). None otherwise (the expert loop runs)."""
    if act != "silu" or not isinstance(ops, FusedCpuOps) or not env.moe_kernel_enabled() \
            or any(type(m) is not GatedMLP for m in mlps):      # a subclass (gpt-oss) has its own arithmetic
        return None
    lins = [a for m in mlps for a in (m.gate_up, m.down) if isinstance(a, CpuBlockLinear)]
    if len(lins) != 2 * len(mlps) or not all(a.q8 and a.b is None for a in lins):
        return None
    isas = {a.isa for a in lins}
    isa = next(iter(isas))
    if len(isas) != 1 or not all(cpu_blockq8.handles(p) and p.data.is_contiguous() for a in lins for p in a.w.parts):
        return None
    gu, dn = [list(a.w.parts) for a in lins[0::2]], [list(a.w.parts) for a in lins[1::2]]
    shapes = {(tuple((p.fmt.name, p.n, p.k) for p in g), tuple((p.fmt.name, p.n, p.k) for p in d))
              for g, d in zip(gu, dn)}
    if len(shapes) != 1 or not cpu_moe_block.available(isa):
        return None
    calls = None
    if any(a.tiled for a in lins):     # tiled decode copies (DecoderModel.tile_experts): the loop's own calls
        calls = ([[w for _, w in a.decode_calls] for a in lins[0::2]],
                 [[w for _, w in a.decode_calls] for a in lins[1::2]])
    return cpu_moe_block.BlockExperts(gu, dn, isa, linear_backends.DECODE_X_BITS, calls)


def packed_experts(mlps: Sequence[GatedMLP], act: str, ops: TorchOps) -> cpu_moe.PackedExperts | None:
    """The experts' cpu_qmatmul copies as one cpu_moe table, when the C call gives their loop's bits: SiLU
    through cpu_ops (FusedCpuOps: the C call's SiLU·mul is its arithmetic), plain GatedMLPs, every gate_up and down a
    layers.Linear packed for cpu_qmatmul at one bit width, no biases, and CHATSERVE_MOE_KERNEL not 0.
    None otherwise (the expert loop runs)."""
    if act != "silu" or not isinstance(ops, FusedCpuOps) or not env.moe_kernel_enabled() \
            or any(type(m) is not GatedMLP for m in mlps):      # a subclass (gpt-oss) has its own arithmetic
        return None
    lins = [(m.gate_up, m.down) for m in mlps]
    if not all(isinstance(a, Linear) and a.qw is not None and a.b is None for pair in lins for a in pair):
        return None
    gu = [a.qw for a, _ in lins]
    dn = [d.qw for _, d in lins]
    assert all(q is not None for q in gu + dn)
    bits = {q.bits for q in gu + dn if q is not None}
    if len(bits) != 1 or not cpu_moe.available():
        return None
    return cpu_moe.PackedExperts([q for q in gu if q is not None], [q for q in dn if q is not None])


def dense(w: torch.Tensor | BlockMatrix, dtype: torch.dtype) -> torch.Tensor:
    """w as a dense tensor: a GGUF matrix kept in its block format (--gguf-in-place) is decoded."""
    if not isinstance(w, BlockMatrix):
        return w
    return torch.cat([block_formats.dequantize(p) for p in w.parts]).to(dtype)
