"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2 with QKV bias, SmolLM2) on the paged KV cache.

One flattened varlen batch per forward (prefill chunks and decodes mixed, no padding). Attention goes
only through chatserve_kernels (store_kv + paged_attention). Not a loader or a sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import chatserve_kernels
from chatserve_kernels import AttentionMetadata
from chatserve.runtime.weights import ArchConfig, rope_inv_freq

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor          # [H]
    qkv: torch.Tensor                 # [q_size + 2 * kv_size, H]  (q, k, v rows fused)
    qkv_bias: torch.Tensor | None     # [q_size + 2 * kv_size]
    o: torch.Tensor                   # [H, q_size]
    post_norm: torch.Tensor           # [H]
    gate_up: torch.Tensor             # [2 * I, H]  (gate rows then up rows)
    down: torch.Tensor                # [H, I]


class LlamaModel:
    """Plain tensors and torch functions (no nn.Module: no hook dispatch on the hot path)."""

    def __init__(self, config: ArchConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_model_len: int | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.scale = config.head_dim ** -0.5

        def t(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = t("model.embed_tokens.weight")                     # [V, H]
        self.norm = t("model.norm.weight")                               # [H]
        if config.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head = self.embed
        else:
            self.lm_head = t("lm_head.weight")                           # [V, H]
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
                input_norm=t(p + "input_layernorm.weight"), qkv=qkv, qkv_bias=bias,
                o=t(a + "o_proj.weight"), post_norm=t(p + "post_attention_layernorm.weight"),
                gate_up=gate_up, down=t(p + "mlp.down_proj.weight")))
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
        # Spelled out: F.rms_norm on CPU dispatches ~10 small ops and costs 2-3x more for one token.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The one attention call site: write this step's K/V into the cache, attend over it."""
        # q: [T, hq, d]; k, v: [T, hkv, d]; caches: [num_blocks, block_size, hkv, d] → [T, hq, d]
        chatserve_kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return chatserve_kernels.paged_attention(q, k_cache, v_cache, meta, scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-normed hidden states [T, H]."""
        cfg = self.config
        T = input_ids.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n_rope = hq + hkv
        cos = self.rope_cos[positions].unsqueeze(1)                      # [T, 1, d]
        sin = self.rope_sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, self.embed)                           # [T, H]
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self._rms_norm(h, lw.input_norm)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias).view(T, n_rope + hkv, d)  # [T, hq+2hkv, d]
            qk = qkv[:, :n_rope]                                         # [T, hq+hkv, d]
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
            attn = self._attention(qk[:, :hq], qk[:, hq:], qkv[:, n_rope:], k_cache, v_cache,
                                   meta, self.scale)                     # [T, hq, d]
            h = h + F.linear(attn.reshape(T, hq * d), lw.o)
            x = self._rms_norm(h, lw.post_norm)
            gu = F.linear(x, lw.gate_up)                                 # [T, 2I]
            g, u = gu.chunk(2, -1)
            h = h + F.linear(F.silu(g) * u, lw.down)                     # [T, H]
        return self._rms_norm(h, self.norm)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] (already normed by forward) → logits [B, V] in float32."""
        return F.linear(hidden, self.lm_head).float()
