"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm with (1 + w), norms before and
after both attention and the MLP, GeGLU, query_pre_attn_scalar, alternating sliding-window and global
layers (Gemma 3: with their own RoPE bases and q/k norms), attention (Gemma 2) and final logit
soft-capping. Config switches come from arch_config.config_from_hf; not a loader.
"""
from __future__ import annotations

from chatserve.runtime.models.decoder import DecoderModel


class GemmaModel(DecoderModel):
    norm_offset = 1.0
    embed_scale = True
    sandwich_norms = True
