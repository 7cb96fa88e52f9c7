"""Shared decoder layers: the weight-only quantized Linear, the norm/RoPE ops with their backend chosen
once (fused C on CPU, plain torch elsewhere: the oracle), Rotary tables, the paged attention call and
the gated MLP. A family module (llama.py, qwen3.py, gemma.py, phi3.py) wires them; none holds weights
of its own or reads a checkpoint.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatserve_kernels import AttentionMetadata, cpu_build, cpu_ops, cpu_qmatmul
from chatserve.runtime.models.linear_backends import BlockLinear, by_row_kind
from chatserve_kernels.attention_backend import AttentionBackend

KVCaches = list[tuple[torch.Tensor, ...]]   # per layer (k, v) or (k, v, k_scale, v_scale)
WEIGHT_QUANTS = (None, "int8", "int4")
INT4_GROUP = 32
SMALL_M = 8          # torch's int4/int8 kernels beat dense GEMMs up to this many rows (see Linear)
PACKED_SMALL_M = 4   # beside packed bf16 GEMMs torch's int4/int8 kernels win only up to 4 rows
QMM_SMALL_M = 16     # cpu_qmatmul beats packed bf16 up to here in a whole model (its weights stream from memory)
DENSE_MIN_M = 4      # fp32 GEMMs of 1-3 rows take other kernels than 4+ (other rounding): pad up to 4
AMX_ROWS = 64        # oneDNN's bf16 GEMM on AMX picks its kernel by M (rows differ at M <= 32 vs 33+, and
                     # again at large M by thread count): prompt rows go in calls of exactly this many rows
BF16_MIN_M = 16      # without AMX (AVX-512 BF16, AMD Zen 4) it picks one kernel for M <= 10 and another for every
                     # M >= 11 (a K = 1,536 row's bits differ; M = 11..1,100, 1 or 2 threads agree): prompt-row
                     # calls of fewer rows are zero-padded up to this many, larger ones run as they are


@dataclass(frozen=True)
class RowSplit:
    """A step's rows by kind, for batch invariance: a generated token's row always takes a Linear's
    quantized copy, a prompt token's row always its dense weight, whatever the step's size, so no
    token's arithmetic depends on the tokens that share its step. gen/prompt: row indices [G]/[P]
    int64, both None when every row is of one kind (all_gen says which)."""
    all_gen: bool
    gen: torch.Tensor | None = None
    prompt: torch.Tensor | None = None

    @staticmethod
    def build(generated: list[bool], device: torch.device) -> "RowSplit":
        if all(generated):
            return ALL_GENERATED
        if not any(generated):
            return ALL_PROMPT
        g = torch.tensor(generated, device=device)
        return RowSplit(False, g.nonzero()[:, 0], (~g).nonzero()[:, 0])


ALL_GENERATED = RowSplit(True)
ALL_PROMPT = RowSplit(False)


@functools.lru_cache(maxsize=2)
def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear runs on this CPU for dtype (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    float32 any x86 CPU oneDNN supports)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _onednn_amx() -> bool:
    """oneDNN's packed bf16 GEMM runs on AMX tiles here (its row bits then depend on M: AMX_ROWS)."""
    return _onednn_packs(torch.bfloat16) and "amx_bf16" in cpu_build.cpu_flags()


class Linear:
    """y = x Wᵀ + b. With a weight_quant, steps of at most `small_m` tokens (decode) use a weight-only
    quantized copy of W; larger steps (prefill) keep the dense weight, where GEMMs are compute-bound.
    The quantized copy, in order of preference:
      cpu_qmatmul (AVX-512 VNNI, or AVX2 + FMA + F16C): 4- or 8-bit codes per group of 32 with an fp16
            scale and low, one pass over the packed weights (int8 means 8-bit codes here);
      torch's kernels otherwise: int8 with per-output-channel scales (torch._weight_int8pack_mm), int4 in
            groups of 32 (torch._weight_int4pack_mm_for_cpu), both with bf16 activations (fp32 ones take a
            generic path several times slower).
    Dense bf16 and fp32 weights on CPU are reordered once into oneDNN's blocked layout
    (mkldnn._linear_pointwise): aten's bf16 matmul reorders W on every call, and MKL's fp32 GEMM picks its
    kernel by M and shape on some CPUs (Sapphire Rapids: rows differ between M = 4..15, 16+ and others),
    while oneDNN's fp32 GEMM gives a row the same bits at every M from 2 up. small_m None takes the
    measured crossover of the kernel in use: SMALL_M, PACKED_SMALL_M beside packed GEMMs, QMM_SMALL_M for cpu_qmatmul
    (docs/benchmarks.md has the figures).

    A model passes each step's RowSplit instead: generated-token rows take the quantized copy and
    prompt rows the dense weight at every step size (batch invariance); rows=None keeps the crossover
    by step size (benchmarks, kernels tests)."""

    __slots__ = ("w", "wt", "b", "wq", "scales", "qw", "small_m", "kind", "act", "packed", "n_out", "fixed_m",
                 "min_m", "dense_bytes", "packed_dtype")
    w: torch.Tensor | None                 # [N, K]; None once the packed oneDNN copy replaces it
    wt: torch.Tensor | None                # [K, N] view of w
    b: torch.Tensor | None                 # [N]
    wq: torch.Tensor | None                # torch's int8 [N, K] / int4-packed weight
    scales: torch.Tensor | None            # their scales
    qw: cpu_qmatmul.PackedWeight | None    # cpu_qmatmul's copy
    packed: torch.Tensor | None            # oneDNN's opaque blocked bf16 weight

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None, weight_quant: str | None = None,
                 small_m: int | None = None) -> None:
        # w: [N, K]; b: [N]
        if weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got {weight_quant!r}")
        self.w, self.b, self.kind = w, b, weight_quant
        self.act = torch.bfloat16      # torch's kernels take fp32 too, but through a slow generic path
        self.wq = self.scales = self.packed = self.qw = None
        N, K = w.shape
        self.n_out = N
        self.dense_bytes = w.numel() * w.element_size()
        self.packed_dtype = w.dtype
        cpu = w.device.type == "cpu"
        if weight_quant and cpu and K % INT4_GROUP == 0 and cpu_qmatmul.available() \
                and float(w.abs().max()) < cpu_qmatmul.FP16_MAX:
            bits = 4 if weight_quant == "int4" else 8
            self.qw = cpu_qmatmul.pack_cached(w, bits)
        elif weight_quant:
            self._torch_quantized(w)
        if w.dtype in (torch.bfloat16, torch.float32) and cpu and _onednn_packs(w.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)   # opaque [N, K] mkldnn
            self.w = None        # the packed copy replaces it (no second copy of the weights)
        # oneDNN's bf16 GEMM picks its kernel, and so a row's bits, by M: batch-invariant rows go in calls of
        # exactly fixed_m rows on AMX (the last one padded), in calls of at least min_m rows elsewhere
        self.fixed_m = self.min_m = 0
        if self.packed is not None and w.dtype == torch.bfloat16:
            if _onednn_amx():
                self.fixed_m = AMX_ROWS
            else:
                self.min_m = BF16_MIN_M
        if small_m is None:
            small_m = QMM_SMALL_M if self.qw is not None else PACKED_SMALL_M if self.packed is not None else SMALL_M
        self.small_m = small_m
        # Wᵀ as a view: mm/addmm on it is what F.linear runs, without its 5-8 dispatcher ops per call
        self.wt = None if self.w is None else self.w.t()

    def _torch_quantized(self, w: torch.Tensor) -> None:
        """wq and scales for torch's int8 (per output channel) or int4 (groups of 32) kernels."""
        N, K = w.shape
        if self.kind == "int4" and (K % INT4_GROUP or w.device.type != "cpu"):
            self.kind = "int8"             # the int4 kernel needs K % 32 == 0 and a CPU
        if self.kind == "int8":
            wf = w.float()
            scales = wf.abs().amax(1).clamp_min(1e-8) / 127.0                     # [N]
            self.wq = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scales = scales.to(self.act)
            return
        # codes [N, K], sc and lo [N, G]: the grid cpu_qmatmul picks per group (a GGUF Q4_0/Q4_1 block exactly)
        q, sc, lo = cpu_qmatmul.quantize(w, 4)
        self.wq = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # dequant: (q - 8) * scale + zero, zero = lo + 8 * scale;  [G, N, 2]
        self.scales = torch.stack([sc, lo + 8.0 * sc], -1).transpose(0, 1).contiguous().to(self.act)

    def bytes_read(self, rows: int) -> int:
        """Weight bytes one call on `rows` rows reads: the quantized copy and its scales, or the dense W."""
        bias = 0 if self.b is None else self.b.numel() * self.b.element_size()
        if self.qw is not None and rows <= self.small_m:
            return self.qw.nbytes() + bias
        if self.wq is not None and self.scales is not None and rows <= self.small_m:
            return (self.wq.numel() * self.wq.element_size()
                    + self.scales.numel() * self.scales.element_size() + bias)
        return self.dense_bytes + bias

    def __call__(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # x: [T, K] → [T, N]
        if rows is None or (self.qw is None and self.wq is None):
            quant = self.qw is not None or self.wq is not None
            if quant and x.dim() == 2 and x.shape[0] <= self.small_m:
                return self._quantized(x)
            return self._dense(x, fixed=rows is not None)         # rows None: no invariance asked
        return by_row_kind(x, rows, self.n_out, self._quantized, self._dense)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] through the quantized copy, at any T (cpu_qmatmul, else torch's int8/int4 kernels)."""
        if self.qw is not None:
            y = cpu_qmatmul.matmul(x if x.dtype in (torch.float32, torch.bfloat16) else x.float(), self.qw)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
            return y if self.b is None else y + self.b
        xa = x if x.dtype == self.act else x.to(self.act)
        assert self.wq is not None and self.scales is not None
        if self.kind == "int8":
            y = torch._weight_int8pack_mm(xa, self.wq, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xa, self.wq, INT4_GROUP, self.scales)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.b is None else y + self.b

    def _dense(self, x: torch.Tensor, fixed: bool = True) -> torch.Tensor:
        """x [T, K] through the dense weight (oneDNN's packed bf16 / fp32, else mm; fp32 steps of 1-3 rows
        are padded to 4, whose kernel every larger step shares). fixed: bf16 rows in calls of exactly
        fixed_m rows (AMX), else of at least min_m rows, zero-padded, so a row's bits never depend on T
        (batch invariance)."""
        T = x.shape[0]
        if x.dim() == 2 and 0 < T < DENSE_MIN_M and x.dtype == torch.float32 and x.device.type == "cpu":
            return self._dense(torch.cat([x, x.new_zeros(DENSE_MIN_M - T, x.shape[1])]), fixed)[:T]
        if self.packed is not None:
            xb = x if x.dtype == self.packed_dtype else x.to(self.packed_dtype)
            if fixed and self.fixed_m and xb.dim() == 2:
                y: torch.Tensor = self._fixed_rows(xb)
            elif fixed and 0 < T < self.min_m and xb.dim() == 2:                   # [min_m, K] → [T, N]
                xp = torch.cat([xb, xb.new_zeros(self.min_m - T, xb.shape[1])])
                y = torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.b, "none", [], "")[:T]
            else:
                y = torch.ops.mkldnn._linear_pointwise(xb, self.packed, self.b, "none", [], "")
            return y if y.dtype == x.dtype else y.to(x.dtype)
        assert self.w is not None and self.wt is not None
        if x.dim() != 2:
            return F.linear(x, self.w, self.b)
        return torch.mm(x, self.wt) if self.b is None else torch.addmm(self.b, x, self.wt)

    def _fixed_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] → [T, N] through oneDNN in calls of exactly fixed_m rows (the tail zero-padded)."""
        T, m = x.shape[0], self.fixed_m
        pad = -T % m
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])                     # [T + pad, K]
        if x.shape[0] == m:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        else:
            y = torch.cat([torch.ops.mkldnn._linear_pointwise(x[i:i + m], self.packed, self.b, "none", [], "")
                           for i in range(0, x.shape[0], m)])
        return y[:T] if pad else y

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b in float32 (the LM head), through the quantized copy at every row count when there is
        one (batch invariance). cpu_qmatmul's output takes x's dtype, so it gets float32 rows (which it
        codes in 15 bits per group, not 8: an int8 LM-head input moved near-ties of the default model's
        greedy answer) and its result is never rounded to bf16 (bf16 logits tie, and a tie makes greedy
        decoding arbitrary);
        the other kernels compute in their own dtype and are cast up."""
        # x: [T, K] → [T, N] float32
        if self.qw is not None:
            return self._quantized(x.float())
        return (self._quantized(x) if self.wq is not None else self._dense(x)).float()


# ---------------------------------------------------------------------------------------------
# norms and RoPE: one backend per model, picked at build

class TorchOps:
    """The readable oracle: float32 statistics, weight applied in the model dtype (as transformers)."""

    name = "torch"

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [T, H] → [T, H]. Spelled out: F.rms_norm on CPU dispatches ~10 small ops.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (x starts the stream when residual is None) → (rms_norm(residual), residual)."""
        residual = x if residual is None else residual + x
        return self.rms_norm(residual, w), residual

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, n, rot]; cos, sin: [T, 1, rot] (this step's rows) → rotated copy
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] = [gate | up] → silu(gate) · up [T, I]."""
        g, u = gu.chunk(2, -1)
        return F.silu(g) * u


class FusedCpuOps(TorchOps):
    """cpu_ops' C kernels: the residual add rides on the norm in place, RoPE rotates in place."""

    name = "cpu_fused"

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cpu_ops.add_rms_norm(x.contiguous(), None, w, self.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return cpu_ops.add_rms_norm(x, None, w, self.eps), x
        return cpu_ops.add_rms_norm(residual, x.contiguous(), w, self.eps), residual   # residual += x

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return cpu_ops.silu_mul(gu.contiguous())     # the decode chain's op: the same bits on both paths


AnyLinear = Linear | BlockLinear       # a dense/quantized Linear, or a GGUF block-format matrix's backend


def pick_ops(eps: float, dtype: torch.dtype, device: torch.device, fused: bool = True) -> TorchOps:
    probe = torch.empty(0, dtype=dtype, device=device)
    return FusedCpuOps(eps) if fused and cpu_ops.usable(probe) else TorchOps(eps)


class Rotary:
    """RoPE over the first `rot` dims of each head, from tables cos/sin [L, rot] (models.rope)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> None:
        self.cos, self.sin = cos, sin                                   # [L, rot], sign folded in sin
        self.rot = cos.shape[-1]
        self.fused = fused
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def begin_step(self, positions: torch.Tensor) -> None:
        """Gather this step's rows once (the torch path); every layer sharing the tables reuses them."""
        if not self.fused:
            self._rows = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, n, d] → rotated [T, n, d] (in place on the fused path)."""
        full = self.rot == x.shape[-1]
        if self.fused and full and x.stride(1) == x.shape[-1]:
            cpu_ops.rope_(x, self.cos, self.sin, positions)
            return x
        cos, sin = self._rows if self._rows is not None else (
            self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        if full:
            return torch.addcmul(x * cos, x.roll(self.rot // 2, -1), sin)
        r = x[..., :self.rot]
        return torch.cat([torch.addcmul(r * cos, r.roll(self.rot // 2, -1), sin), x[..., self.rot:]], -1)


# ---------------------------------------------------------------------------------------------
# attention

@dataclass
class StepInfo:
    """Per-step facts every layer shares (built once per forward by the model)."""
    meta: AttentionMetadata
    positions: torch.Tensor        # [T] int64
    all_slots_valid: bool          # no -1 in slot_mapping: store_kv skips its mask
    backend: AttentionBackend      # the model's, picked once
    rows: RowSplit | None          # generated vs prompt rows (None: the Linears' step-size crossover)


class Attention:
    """Store this step's K/V in the layer's paged cache and attend over it through the model's
    attention backend (chatserve_kernels.attention_backend); sinks: gpt-oss's per-head logits."""

    def __init__(self, scale: float, sliding_window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None = None) -> None:
        # sinks: [q_heads] float32
        self.scale, self.window, self.softcap, self.sinks = scale, sliding_window, softcap, sinks

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cache: tuple[torch.Tensor, ...], step: StepInfo) -> torch.Tensor:
        # q: [T, hq, d]; k, v: [T, hkv, d]; cache: (k, v[, k_scale, v_scale]) of
        # [num_blocks, block_size, hkv, d] → [T, hq, d]
        if self.softcap and len(cache) == 4:
            raise ValueError("attention logit soft-capping needs an unquantized KV cache")
        step.backend.store(k, v, cache, step.meta.slot_mapping, step.all_slots_valid)
        return step.backend.attend(q, cache, step.meta, self.scale, self.window, self.softcap, self.sinks)


# ---------------------------------------------------------------------------------------------
# MLP

class GatedMLP:
    """down(act(gate(x)) · up(x)) with gate and up fused in one matmul: SwiGLU (silu, through the
    model's ops: the C op on CPU) or GeGLU (gelu_pytorch_tanh, Gemma)."""

    def __init__(self, gate_up: AnyLinear, down: AnyLinear, act: str, ops: TorchOps) -> None:
        self.gate_up, self.down = gate_up, down
        if act == "silu":
            self.act_mul = ops.silu_mul
        elif act == "gelu_pytorch_tanh":
            self.act_mul = _gelu_mul
        else:
            raise ValueError(f"activation {act!r}")

    def __call__(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # x: [T, H] → [T, H]
        return self.down(self.act_mul(self.gate_up(x, rows)), rows)                # gate_up: [T, 2I]

    def bytes_read(self, rows: int) -> int:
        """Weight bytes one call on `rows` rows reads."""
        return self.gate_up.bytes_read(rows) + self.down.bytes_read(rows)


def _gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, -1)                                                          # [T, I] each
    return F.gelu(g, approximate="tanh") * u
