"""Qwen3: the Llama layout with a per-head RMSNorm on q and k before RoPE (config.qk_norm) and, with
attention_bias, biases on q/k/v/o. Not a loader (weights.py)."""
from __future__ import annotations

from chatserve.runtime.models.decoder import DecoderModel


class Qwen3Model(DecoderModel):
    """config.qk_norm reads self_attn.{q,k}_norm.weight [head_dim]; the loop applies them."""
