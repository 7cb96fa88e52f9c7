"""The decoder every family shares: exact weight reading (WeightReader), one layer loop written once,
final norm and LM head. A family subclasses DecoderModel to name its tensors and switch on its quirks
(see llama.py, qwen3.py, gemma.py, phi3.py); models/__init__.py maps config.arch to the class.

One flattened varlen batch per forward (prefill chunks and decodes mixed, no padding) on the paged KV
cache; plain tensors and torch functions (no nn.Module: no hook dispatch on the hot path).
"""
from __future__ import annotations

from typing import Any, overload

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatserve.runtime.models.layers import (AnyLinear, Attention, GatedMLP, KVCaches, Linear, Rotary, RowSplit,
                                             StepInfo, pick_ops)
from chatserve.runtime.models.linear_backends import (DECODE_X_BITS, BlockLinear, BlockMatrix, CpuBlockLinear,
                                                      TorchBlockLinear, cat_rows)
from chatserve.runtime.models.moe import MoE
from chatserve.runtime.models.rope import rope_tables
from chatserve.runtime.arch_config import ArchConfig, MoESpec, UnsupportedModelError
from chatserve_kernels import AttentionMetadata, cpu_blockq8, cpu_decode, cpu_qmatmul, env
from chatserve_kernels.attention_backend import AttentionBackend, pick_attention_backend

# checkpoint tensors that carry nothing the model needs (buffers some exporters save)
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightReader:
    """Hands out checkpoint tensors by name and remembers which were taken: a tensor the model needs
    but the checkpoint lacks, or one the checkpoint has and nothing took, is a load error."""

    def __init__(self, tensors: dict[str, torch.Tensor | BlockMatrix], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.tensors, self.dtype, self.device = tensors, dtype, device
        self.taken: set[str] = set()
        self.missing: list[str] = []

    def __call__(self, name: str, when: bool = True) -> Any:
        """The tensor (in the model dtype, on the model device), a BlockMatrix for a matrix kept in its
        GGUF block format, None when `when` is False or it is missing (then check_missing raises). Typed
        Any: which of the three a name gives is the family's knowledge, checked by check_missing."""
        if not when:
            return None
        t = self.tensors.get(name)
        if t is None:
            self.missing.append(name)
            return None
        self.taken.add(name)
        if isinstance(t, BlockMatrix):          # kept in its file's block format (linear_backends.py)
            return t
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def skip(self, name: str) -> None:
        """Mark a tensor as knowingly unused (e.g. a tied LM head saved beside the embeddings)."""
        if name in self.tensors:
            self.taken.add(name)

    def check_missing(self) -> None:
        if self.missing:
            raise UnsupportedModelError(_names("the checkpoint lacks tensor(s) the model needs", self.missing))

    def check_all_taken(self) -> None:
        unused = sorted(n for n in self.tensors
                        if n not in self.taken and not n.endswith(HARMLESS_SUFFIXES))
        if unused:
            raise UnsupportedModelError(_names("the checkpoint has tensor(s) this model would not use",
                                               unused))


def _qk_norm(ops: Any, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm of q or k before RoPE: per head when w is [d] (Qwen3, Gemma 3), over all the row's heads
    when w is [n·d] (OLMoE). x: [T, n, d] → [T, n, d]."""
    assert w is not None
    T, n, d = x.shape
    rows = T * n if w.shape[0] == d else T
    out: torch.Tensor = ops.rms_norm(x.reshape(rows, -1), w).view(T, n, d)
    return out


def _names(what: str, names: list[str], shown: int = 6) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{what}: {', '.join(names[:shown])}{more}"


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor                 # [H]
    qkv: AnyLinear                           # [q_size + 2 * kv_size, H]  (q, k, v rows fused)
    q_norm: torch.Tensor | None              # [d]  (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None              # [d]
    o: AnyLinear                             # [H, q_size]
    post_attn_norm: torch.Tensor | None      # [H]  (Gemma: normed before the residual add)
    pre_ffn_norm: torch.Tensor               # [H]
    mlp: GatedMLP | MoE                      # MoE: models/moe.py
    post_ffn_norm: torch.Tensor | None       # [H]  (Gemma)
    rotary: Rotary
    attention: Attention


class DecoderModel:
    """Llama-shaped decoder: pre-norm attention and gated MLP with the residual riding on the norms
    (x, residual = add_rms_norm(x, residual)). Subclasses set the switches below and name tensors."""

    norm_offset = 0.0          # Gemma stores RMSNorm weights as w with scale (1 + w): folded in at load
    embed_scale = False        # Gemma multiplies embeddings by sqrt(hidden_size)
    sandwich_norms = False     # Gemma 2/3: norms after attention and after the MLP, before each add

    def __init__(self, config: ArchConfig, tensors: dict[str, torch.Tensor | BlockMatrix],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_model_len: int | None = None, weight_quant: str | None = None,
                 fused: bool = True, block_backend: type[BlockLinear] = TorchBlockLinear) -> None:
        """fused: use the CPU C ops where they run (False: the plain torch oracle). block_backend: the
        LinearBackend of matrices kept in a GGUF block format (chosen once at load)."""
        self.config = config
        self.block_backend = block_backend
        self.weight_quant = weight_quant
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.ops = pick_ops(config.rms_norm_eps, dtype, self.device, fused)
        fused_ops = self.ops.name == "cpu_fused"
        self.fused = fused
        self.flash_rows = 0          # CpuAttention's flash_rows: set by a runner without batch invariance
        self.attention_backend: AttentionBackend | None = None     # picked for the caches at their first forward
        self._backend_caches: KVCaches | None = None
        r = WeightReader(tensors, dtype, self.device)

        self.embed = r("model.embed_tokens.weight")                       # [V, H]
        self.norm = self._norm_weight(r("model.norm.weight"))            # [H]
        if config.tie_word_embeddings:
            r.skip("lm_head.weight")
            lm_head = self.embed
        else:
            lm_head = r("lm_head.weight")                                 # [V, H]
        r.check_missing()
        # [V, H]: 8-bit codes beat the dense head up to 16 rows. It stays 8-bit under int4: its error is what
        # the logits show
        head_quant = "int8" if weight_quant == "int4" else weight_quant
        self.lm_head = (block_backend(lm_head, None, True) if isinstance(lm_head, BlockMatrix)
                        else Linear(lm_head, None, head_quant, small_m=16))
        self.normalizer = (torch.tensor(math.sqrt(config.hidden_size), dtype=dtype)
                           if self.embed_scale else None)

        qpas = config.query_pre_attn_scalar
        scale = (qpas if qpas else config.head_dim) ** -0.5
        rotaries: dict[bool, Rotary] = {}

        def rotary(local: bool) -> Rotary:
            if local not in rotaries:
                cos, sin = rope_tables(config, self.max_model_len, local=local, dtype=dtype)
                rotaries[local] = Rotary(cos.to(self.device), sin.to(self.device), fused_ops)
            return rotaries[local]

        self.layers: list[DecoderLayer] = [self._read_layer(r, i, scale, rotary) for i in range(config.num_layers)]
        r.check_all_taken()
        self._rotaries = list(rotaries.values())
        self.chain = self._decode_chain(fused_ops)

    def _read_layer(self, r: WeightReader, i: int, scale: float, rotary: Callable[[bool], Rotary]) -> DecoderLayer:
        """Layer i's weights (taken from r) as a DecoderLayer; rotary(local) gives the shared RoPE tables."""
        config, p = self.config, f"model.layers.{i}."
        window = config.layer_window(i)
        qkv_w, qkv_b, o_w, o_b = self.read_attention(r, p + "self_attn.")
        mlp = self.build_mlp(r, p, i)
        norms = self.read_norms(r, p)
        sinks = r(p + "self_attn.sinks", config.attention_sinks)                 # [hq] (gpt-oss)
        q_norm = r(p + "self_attn.q_norm.weight", config.qk_norm)
        k_norm = r(p + "self_attn.k_norm.weight", config.qk_norm)
        r.check_missing()
        assert mlp is not None                    # else check_missing raised
        nw = self._norm_weight
        return DecoderLayer(
            input_norm=nw(norms[0]), qkv=self._lin(qkv_w, qkv_b, tile=True),
            q_norm=nw(q_norm), k_norm=nw(k_norm), o=self._lin(o_w, o_b, tile=True),
            post_attn_norm=nw(norms[1]), pre_ffn_norm=nw(norms[2]),
            mlp=mlp,
            post_ffn_norm=nw(norms[3]),
            rotary=rotary(window is not None and config.local_rope_theta is not None),
            attention=Attention(scale, window, config.attn_logit_softcap,
                                None if sinks is None else sinks.float()))

    def _decode_chain(self, fused_ops: bool) -> cpu_decode.DecodeChain | None:
        """The C chain for few-row decode steps, where every layer is the plain pre-norm SwiGLU one with
        packed quantized matrices (else None: the torch path runs every step)."""
        c = self.config
        first = self.layers[0].qkv
        tiled = isinstance(first, CpuBlockLinear)
        if not (fused_ops and cpu_decode.usable(self.dtype, tiled) and c.hidden_act == "silu"
                and len(self._rotaries) == 1 and self._rotaries[0].rot == c.head_dim):
            return None
        if not isinstance(first, Linear) and not tiled:
            return None
        small_m = first.small_m

        def packed(m: AnyLinear) -> cpu_decode.ChainMatrix | None:
            """m's cpu_qmatmul copy, or (in place) its bands' tiled copies, when the chain can run it (no bias,
            the first layer's crossover; every band tiled, so a row's arithmetic is the layer loop's)."""
            if isinstance(m, CpuBlockLinear) and tiled and m.b is None and m.small_m == small_m:
                calls = [w for _, w in m.decode_calls if isinstance(w, cpu_blockq8.TiledWeight)]
                ok = len(calls) == len(m.decode_calls)
                return cpu_decode.TiledBands(calls, m.isa, DECODE_X_BITS) if ok else None
            return m.qw if isinstance(m, Linear) and m.b is None and m.small_m == small_m else None
        layers = []
        for ly in self.layers:
            if not isinstance(ly.mlp, GatedMLP):
                return None
            qkv, o, gate_up, down = (packed(m) for m in (ly.qkv, ly.o, ly.mlp.gate_up, ly.mlp.down))
            plain = (ly.q_norm is None and ly.k_norm is None and ly.post_attn_norm is None
                     and ly.post_ffn_norm is None and not ly.attention.window and not ly.attention.softcap
                     and ly.attention.sinks is None)
            if not plain or qkv is None or o is None or gate_up is None or down is None:
                return None
            layers.append(cpu_decode.ChainLayer(ly.input_norm, qkv, o, ly.pre_ffn_norm, gate_up, down))
        rot = self._rotaries[0]
        return cpu_decode.DecodeChain(layers, self.norm, c.rms_norm_eps, c.num_heads, c.num_kv_heads,
                                      c.head_dim, self.layers[0].attention.scale, rot.cos, rot.sin,
                                      self.dtype, small_m)

    # ── what a family names differently ──────────────────────────────────────────────────────
    def read_attention(self, r: WeightReader, a: str) -> tuple[Any, ...]:
        """(qkv weight [q+2kv, H], qkv bias or None, o weight [H, q], o bias or None)."""
        c = self.config
        ws = [r(a + f"{n}_proj.weight") for n in "qkv"]
        bs = [r(a + f"{n}_proj.bias", c.attention_bias) for n in "qkv"]
        o_w, o_b = r(a + "o_proj.weight"), r(a + "o_proj.bias", c.o_bias)
        if None in ws or (c.attention_bias and None in bs):
            return None, None, o_w, o_b                   # reported by check_missing
        return cat_rows(ws), (torch.cat(bs) if c.attention_bias else None), o_w, o_b

    def build_mlp(self, r: WeightReader, p: str, i: int) -> GatedMLP | MoE | None:
        """Layer i's feed-forward block (p: the layer's tensor prefix); MoE families override it.
        None when a tensor is missing (r records it)."""
        gu_w, gu_b, down_w, down_b = self.read_mlp(r, p + "mlp.")
        if gu_w is None or down_w is None:
            return None
        return GatedMLP(self._lin(gu_w, gu_b, tile=True), self._lin(down_w, down_b, tile=True), self.config.hidden_act,
                        self.ops)

    def read_mlp(self, r: WeightReader, m: str) -> tuple[Any, ...]:
        """(gate_up weight [2I, H] (gate rows, then up rows), its bias, down weight [H, I], its bias)."""
        b = self.config.mlp_bias
        g, u, d = r(m + "gate_proj.weight"), r(m + "up_proj.weight"), r(m + "down_proj.weight")
        gb, ub, db = r(m + "gate_proj.bias", b), r(m + "up_proj.bias", b), r(m + "down_proj.bias", b)
        gu = None if g is None or u is None else cat_rows([g, u])
        gub = None if gb is None or ub is None else torch.cat([gb, ub])
        return gu, gub, d, db

    def read_norms(self, r: WeightReader, p: str) -> tuple[Any, ...]:
        """(input, post-attention, pre-MLP, post-MLP) norm weights; None where the family has none."""
        if self.sandwich_norms:
            return (r(p + "input_layernorm.weight"), r(p + "post_attention_layernorm.weight"),
                    r(p + "pre_feedforward_layernorm.weight"), r(p + "post_feedforward_layernorm.weight"))
        return r(p + "input_layernorm.weight"), None, r(p + "post_attention_layernorm.weight"), None

    @property
    def moe_spec(self) -> MoESpec:
        """The config's MoE block (a MoE family's config always has one: arch_config reads it)."""
        assert self.config.moe is not None, f"{self.config.arch}: no MoE block in the config"
        return self.config.moe

    # ── build helpers ────────────────────────────────────────────────────────────────────────
    @overload
    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor: ...

    @overload
    def _norm_weight(self, w: None) -> None: ...

    def _norm_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        if w is None or not self.norm_offset:
            return w
        return (w.float() + self.norm_offset).to(self.dtype)         # (1 + w) in float32, as Gemma does

    def _lin(self, w: torch.Tensor | BlockMatrix, b: torch.Tensor | None = None, tile: bool = False) -> AnyLinear:
        """A dense/quantized Linear, or the block backend for a GGUF matrix kept in place (tile: the dense
        layers' matrices, whose generated rows may run a re-laid copy; not MoE experts)."""
        if isinstance(w, BlockMatrix):
            return self.block_backend(w, b, tile)
        return Linear(w, b, self.weight_quant)

    def _expert_lin(self, w: torch.Tensor | BlockMatrix, b: torch.Tensor | None = None) -> AnyLinear:
        """A MoE expert's matrix as _lin makes it, its generated rows on a tiled copy when tile_experts()."""
        return self._lin(w, b, tile=self.tile_experts())

    def tile_experts(self) -> bool:
        """Whether GGUF-in-place experts get the dense layers' row-interleaved decode copy (the per-lane kernel
        on the file's blocks is bound by its per-lane float work at the 1-16 rows a decode step routes to an
        expert): CHATSERVE_MOE_TILED 1 / 0, else when every MoE layer's copy, at most a byte per weight (Q4_K
        4.5 bits → 6, Q6_K 6.6 → 7, Q8_0 8.5 → 9), fits a quarter of the machine's memory (a 2-layer test
        shape yes, Qwen3-30B-A3B's 29 G weights on a 24 GiB box no: its experts then stay the file's only)."""
        choice = env.moe_tiled()
        if choice is not None or self.config.moe is None:
            return bool(choice)
        m = self.config.moe
        weights = sum(m.sparse_layers) * m.num_experts * 3 * m.expert_size * self.config.hidden_size
        return weights <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → embedding rows [T, H] in the model dtype."""
        if isinstance(self.embed, BlockMatrix):
            return self.embed.rows(input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)          # [T, H]

    # ── forward ──────────────────────────────────────────────────────────────────────────────
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata, rows: RowSplit | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-normed hidden states [T, H]. rows: which rows are
        generated tokens and which prompt tokens (the runner's; batch invariance), None: the Linears
        pick their path by step size."""
        c = self.config
        T = input_ids.shape[0]
        if T and int(positions.max()) >= self.max_model_len:          # C reads the tables unchecked
            raise IndexError(f"position {int(positions.max())} beyond the RoPE tables ({self.max_model_len})")
        x = self.embed_rows(input_ids)                                    # [T, H]
        if self.normalizer is not None:
            x = x * self.normalizer
        if kv_caches is not self._backend_caches:          # new caches (a runner's are one list for life)
            self.attention_backend = pick_attention_backend(self.dtype, c.num_heads, kv_caches[0],
                                                            oracle=not self.fused, flash_rows=self.flash_rows)
            self._backend_caches = kv_caches
        assert self.attention_backend is not None
        if (self.chain is not None and (rows is None or rows.all_gen) and self.attention_backend.name == "cpu-c"
                and self.chain.takes(x, meta)):
            return self.chain.run(x, positions, meta, kv_caches)
        step = StepInfo(meta, positions, bool((meta.slot_mapping >= 0).all()) if T else True,
                        self.attention_backend, rows)
        for rot in self._rotaries:
            rot.begin_step(positions)
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        ops = self.ops
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = ops.add_rms_norm(x, residual, layer.input_norm)
            qkv = layer.qkv(x, rows).view(T, hq + 2 * hkv, d)             # [T, hq+2hkv, d]
            v = qkv[:, hq + hkv:]
            if layer.q_norm is not None:
                q = layer.rotary(_qk_norm(ops, qkv[:, :hq], layer.q_norm), positions)
                k = layer.rotary(_qk_norm(ops, qkv[:, hq:hq + hkv], layer.k_norm), positions)
            else:
                qk = layer.rotary(qkv[:, :hq + hkv], positions)           # [T, hq+hkv, d]
                q, k = qk[:, :hq], qk[:, hq:]
            attn = layer.attention(q, k, v, cache, step)                  # [T, hq, d]
            x = layer.o(attn.reshape(T, hq * d), rows)                    # [T, H]
            if layer.post_attn_norm is not None:
                x = ops.rms_norm(x, layer.post_attn_norm)
            x, residual = ops.add_rms_norm(x, residual, layer.pre_ffn_norm)
            x = layer.mlp(x, rows)
            if layer.post_ffn_norm is not None:
                x = ops.rms_norm(x, layer.post_ffn_norm)
        return ops.add_rms_norm(x, residual, self.norm)[0]

    __call__ = forward

    def describe_backends(self) -> str:
        """The kernels this model runs, chosen at load: attention, linears, norms, the decode chain."""
        lin = self.layers[0].qkv
        if isinstance(lin, BlockLinear):
            linears = f"{lin.name} on the file's blocks ({'/'.join(lin.w.formats())}) for every row"
            if isinstance(lin, CpuBlockLinear) and lin.tiled:
                linears += " (generated rows: a row-interleaved copy of them)"
        else:
            quant = (f"cpu_qmatmul ({cpu_qmatmul.level()})" if lin.qw is not None
                     else f"torch {lin.kind}" if lin.wq is not None else None)
            dense = "oneDNN bf16" if lin.packed is not None else f"torch {str(self.dtype).replace('torch.', '')}"
            linears = f"{quant} for generated rows, {dense} for prompt rows" if quant else dense
        attn = self.attention_backend.name if self.attention_backend is not None else "picked at the first step"
        return (f"attention {attn}; linears {linears}; norms {self.ops.name}; "
                f"decode chain {'on' if self.chain is not None else 'off'}")

    def block_copy_bytes(self) -> int:
        """Bytes the block backends hold beside the mapped GGUF (the decode rows' row-interleaved copies of
        Q4_0/Q4_1/Q8_0/Q4_K/Q6_K bands at the AVX2 and AVX-512 levels; their mapped pages are then read by prompt
        rows only)."""
        lins = [self.lm_head] + [m for ly in self.layers for m in (ly.qkv, ly.o)]
        lins += [m for ly in self.layers if isinstance(ly.mlp, GatedMLP) for m in (ly.mlp.gate_up, ly.mlp.down)]
        return sum(m.resident_bytes() for m in lins if isinstance(m, BlockLinear))

    def decode_weight_bytes(self, rows: int = 1) -> int:
        """Weight bytes a forward + LM head over `rows` tokens reads (matrices, norms, embedding rows):
        the numerator of the memory-bandwidth floor of a decode step."""
        lins = [self.lm_head] + [m for ly in self.layers for m in (ly.qkv, ly.o)]
        norms: list[torch.Tensor] = [self.norm] + [
            n for ly in self.layers for n in (ly.input_norm, ly.q_norm, ly.k_norm, ly.post_attn_norm,
                                              ly.pre_ffn_norm, ly.post_ffn_norm) if n is not None]
        embed_rows = rows * (self.embed.nbytes() // self.embed.n if isinstance(self.embed, BlockMatrix)
                             else self.embed.shape[1] * self.embed.element_size())
        return (sum(m.bytes_read(rows) for m in lins) + sum(ly.mlp.bytes_read(rows) for ly in self.layers)
                + sum(n.numel() * n.element_size() for n in norms) + embed_rows)

    def decode_matmul_bytes(self) -> float:
        """Mean weight bytes of one matmul of a one-token decode step (the layers' four and the LM head)."""
        return self.decode_weight_bytes(1) / (4 * len(self.layers) + 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] (already normed by forward) → logits [B, V] in float32."""
        logits = self.lm_head.float_out(hidden)
        cap = self.config.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
