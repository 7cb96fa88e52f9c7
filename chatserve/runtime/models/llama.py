"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2 with QKV bias, SmolLM2) on the paged KV cache.

One flattened varlen batch per forward (prefill chunks and decodes mixed, no padding). Attention goes
only through chatserve_kernels (store_kv + paged_attention). Not a loader or a sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import chatserve_kernels
from chatserve_kernels import AttentionMetadata, cpu_ops
from chatserve.runtime.weights import ArchConfig, rope_inv_freq

KVCaches = list[tuple[torch.Tensor, ...]]   # per layer (k, v) or (k, v, k_scale, v_scale)
WEIGHT_QUANTS = (None, "int8", "int4")
INT4_GROUP = 32
PACKED_SMALL_M = 4   # beside packed bf16 GEMMs the int4/int8 kernels win only up to 4 rows (see Linear)


class Linear:
    """y = x Wᵀ + b. With a weight_quant, steps of at most `small_m` tokens (decode) use a weight-only
    quantized copy of W; larger steps (prefill) keep the dense weight, where GEMMs are compute-bound.
      int8: per-output-channel scales, torch._weight_int8pack_mm (a quarter of fp32's bytes);
      int4: groups of 32 along K with a scale and a zero (min/max, asymmetric; GGUF Q4_1 blocks map onto
            it), torch._weight_int4pack_mm_for_cpu (CPU only; an eighth of fp32's bytes plus scales).
    Activations go in as bf16 (with fp32 the kernels fall back to a path 3-6× slower). Both kernels
    cost about one GEMV per row: on this model's layer shapes int8 beats fp32 up to M ≈ 8 (M=1: 243 vs
    495 µs per layer; M=8: 961 vs 1495; M=16: 1803 vs 1595), and on the 49k-row LM head up to M = 16
    (17.7 vs 20.2 ms), hence the two defaults.
    Dense bf16 weights on CPU are reordered once into oneDNN's blocked layout (mkldnn._linear_pointwise):
    aten's bf16 matmul reorders W on every call (2-core AMD EPYC, 2 threads, the 4 layer matrices: M=16
    255 → 182 µs, M=256 1.95 → 1.84 ms, both ≈ 4.5× fp32's MKL sgemm on that CPU). Beside them the
    quantized kernels win only up to M = 4 (layers M=8: int4 189 vs 134 µs; LM head M=8: int8 1.79 vs
    1.22 ms, M=4: 0.83 vs 1.06), so small_m drops to PACKED_SMALL_M."""

    __slots__ = ("w", "b", "wq", "scales", "small_m", "kind", "act", "packed")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None, weight_quant: str | None = None,
                 small_m: int = 8) -> None:
        # w: [N, K]; b: [N]
        if weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANTS}, got {weight_quant!r}")
        self.w, self.b, self.small_m, self.kind = w, b, small_m, weight_quant
        self.act = torch.bfloat16      # both kernels take fp32 too, but 3-6× slower (a generic path)
        self.wq = self.scales = self.packed = None
        N, K = w.shape
        if w.dtype == torch.bfloat16 and w.device.type == "cpu" and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)   # opaque [N, K] mkldnn
            self.small_m = min(small_m, PACKED_SMALL_M)
        if weight_quant == "int4" and (K % INT4_GROUP or w.device.type != "cpu"):
            self.kind = weight_quant = "int8"          # the int4 kernel needs K % 32 == 0 and a CPU
        if weight_quant == "int8":
            wf = w.float()
            scales = wf.abs().amax(1).clamp_min(1e-8) / 127.0                     # [N]
            self.wq = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scales = scales.to(self.act)
        elif weight_quant == "int4":
            g = w.float().reshape(N, K // INT4_GROUP, INT4_GROUP)                 # [N, G, 32]
            lo, hi = g.amin(-1), g.amax(-1)                                       # [N, G]
            sc = ((hi - lo) / 15.0).clamp_min(1e-8)
            q = torch.round((g - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.int32)
            self.wq = torch._convert_weight_to_int4pack_for_cpu(q.reshape(N, K), 1)
            # dequant: (q - 8) * scale + zero, zero = lo + 8 * scale;  [G, N, 2]
            self.scales = torch.stack([sc, lo + 8.0 * sc], -1).transpose(0, 1).contiguous().to(self.act)
        if self.packed is not None:
            self.w = None        # the packed copy replaces it (no second copy of the weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] → [T, N]
        if self.wq is not None and x.shape[0] <= self.small_m:
            xa = x if x.dtype == self.act else x.to(self.act)
            if self.kind == "int8":
                y = torch._weight_int8pack_mm(xa, self.wq, self.scales)
            else:
                y = torch._weight_int4pack_mm_for_cpu(xa, self.wq, INT4_GROUP, self.scales)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
            return y if self.b is None else y + self.b
        if self.packed is not None:
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            y = torch.ops.mkldnn._linear_pointwise(xb, self.packed, self.b, "none", [], "")
            return y if y.dtype == x.dtype else y.to(x.dtype)
        return F.linear(x, self.w, self.b)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor          # [H]
    qkv: Linear                       # [q_size + 2 * kv_size, H]  (q, k, v rows fused), bias (Qwen2)
    o: Linear                         # [H, q_size]
    post_norm: torch.Tensor           # [H]
    gate_up: Linear                   # [2 * I, H]  (gate rows then up rows)
    down: Linear                      # [H, I]


class LlamaModel:
    """Plain tensors and torch functions (no nn.Module: no hook dispatch on the hot path)."""

    def __init__(self, config: ArchConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_model_len: int | None = None, weight_quant: str | None = None) -> None:
        self.config = config
        self.weight_quant = weight_quant
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.scale = config.head_dim ** -0.5
        self.fused = True             # CPU: fused elementwise ops (cpu_ops) when built; False = torch ops

        def t(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = t("model.embed_tokens.weight")                     # [V, H]
        self.norm = t("model.norm.weight")                               # [H]
        if config.tie_word_embeddings or "lm_head.weight" not in tensors:
            lm_head = self.embed
        else:
            lm_head = t("lm_head.weight")                                # [V, H]
        # [V, H]: int8 wins to M = 16. The head stays int8 under int4: its error is what the logits show
        head_quant = "int8" if weight_quant == "int4" else weight_quant
        self.lm_head = Linear(lm_head, None, head_quant, small_m=16)

        def lin(w: torch.Tensor, b: torch.Tensor | None = None) -> Linear:
            return Linear(w, b, weight_quant)

        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([t(a + "q_proj.weight"), t(a + "k_proj.weight"), t(a + "v_proj.weight")])
            bias = None
            if config.attention_bias and (a + "q_proj.bias") in tensors:
                bias = torch.cat([t(a + "q_proj.bias"), t(a + "k_proj.bias"), t(a + "v_proj.bias")])
            gate_up = torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")])
            self.layers.append(LayerWeights(
                input_norm=t(p + "input_layernorm.weight"), qkv=lin(qkv, bias),
                o=lin(t(a + "o_proj.weight")), post_norm=t(p + "post_attention_layernorm.weight"),
                gate_up=lin(gate_up), down=lin(t(p + "mlp.down_proj.weight"))))
        # RoPE tables over every position, rotate-half layout with the sign folded into sin:
        #   rope(x) = x * cos + roll(x, d/2) * sin_signed,  roll(x, d/2) = [x2, x1], sin_signed = [-s, s]
        inv = rope_inv_freq(config).to(self.device)                      # [d/2]
        pos = torch.arange(self.max_model_len, device=self.device, dtype=torch.int64).float()
        ang = torch.outer(pos, inv)                                      # [L, d/2]
        cos, sin = ang.cos(), ang.sin()
        self.rope_cos = torch.cat([cos, cos], -1).to(dtype)              # [L, d]
        self.rope_sin = torch.cat([-sin, sin], -1).to(dtype)             # [L, d]

    # ---------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [T, H] → [T, H]; statistics in float32, weight applied in the model dtype (as transformers).
        # Spelled out: F.rms_norm on CPU dispatches ~10 small ops (≈ 43 µs vs ≈ 30 µs per decode row).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """The one attention call site: write this step's K/V into the cache, attend over it."""
        # q: [T, hq, d]; k, v: [T, hkv, d]; cache: (k, v[, k_scale, v_scale]) with k, v of
        # [num_blocks, block_size, hkv, d] → [T, hq, d]
        kw = {}
        if len(cache) == 4:
            kw = {"k_scale": cache[2], "v_scale": cache[3]}
        chatserve_kernels.store_kv(k, v, cache[0], cache[1], meta.slot_mapping,
                                   all_valid=meta.all_slots_valid, **kw)
        if self.config.sliding_window:
            kw["sliding_window"] = self.config.sliding_window
        return chatserve_kernels.paged_attention(q, cache[0], cache[1], meta, self.scale, **kw)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-normed hidden states [T, H]."""
        cfg = self.config
        h = F.embedding(input_ids, self.embed)                           # [T, H]
        if self.fused and cpu_ops.usable(h):
            return self._forward_fused(h, positions, kv_caches, meta)
        T = input_ids.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n_rope = hq + hkv
        cos = self.rope_cos[positions].unsqueeze(1)                      # [T, 1, d]
        sin = self.rope_sin[positions].unsqueeze(1)
        for lw, cache in zip(self.layers, kv_caches):
            x = self._rms_norm(h, lw.input_norm)
            qkv = lw.qkv(x).view(T, n_rope + hkv, d)                     # [T, hq+2hkv, d]
            qk = qkv[:, :n_rope]                                         # [T, hq+hkv, d]
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
            attn = self._attention(qk[:, :hq], qk[:, hq:], qkv[:, n_rope:], cache, meta)  # [T, hq, d]
            h = h + lw.o(attn.reshape(T, hq * d))
            x = self._rms_norm(h, lw.post_norm)
            gu = lw.gate_up(x)                                           # [T, 2I]
            g, u = gu.chunk(2, -1)
            h = h + lw.down(F.silu(g) * u)                               # [T, H]
        return self._rms_norm(h, self.norm)

    def _forward_fused(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                       meta: AttentionMetadata) -> torch.Tensor:
        """forward() with the elementwise ops fused on CPU (cpu_ops): residual adds ride on the next
        RMSNorm, RoPE rotates q and k in place inside the qkv output. h: [T, H] embeddings."""
        cfg = self.config
        T = h.shape[0]
        hq, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        n_rope = hq + hkv
        if T and int(positions.max()) >= self.rope_cos.shape[0]:      # C reads the tables unchecked
            raise IndexError(f"position {int(positions.max())} beyond the RoPE tables "
                             f"({self.max_model_len})")
        pending = None                                                   # the last down_proj output
        for lw, cache in zip(self.layers, kv_caches):
            x = cpu_ops.add_rms_norm(h, pending, lw.input_norm, eps)    # h += pending
            qkv = lw.qkv(x).view(T, n_rope + hkv, d)                     # [T, hq+2hkv, d]
            cpu_ops.rope_(qkv[:, :n_rope], self.rope_cos, self.rope_sin, positions)
            attn = self._attention(qkv[:, :hq], qkv[:, hq:n_rope], qkv[:, n_rope:], cache, meta)
            x = cpu_ops.add_rms_norm(h, lw.o(attn.reshape(T, hq * d)), lw.post_norm, eps)
            g, u = lw.gate_up(x).chunk(2, -1)                            # [T, I] each
            pending = lw.down(F.silu(g) * u)                             # [T, H]
        return cpu_ops.add_rms_norm(h, pending, self.norm, eps)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] (already normed by forward) → logits [B, V] in float32."""
        return self.lm_head(hidden).float()
