"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): the Llama layout with q/k/v stored fused as qkv_proj and
gate/up as gate_up_proj, LongRoPE ("longrope"/"su") scaling and partial rotary (Phi-4-mini).
Not a loader (weights.py)."""
from __future__ import annotations

from typing import Any

from chatserve.runtime.models.decoder import DecoderModel, WeightReader


class Phi3Model(DecoderModel):
    def read_attention(self, r: WeightReader, a: str) -> tuple[Any, ...]:
        return r(a + "qkv_proj.weight"), None, r(a + "o_proj.weight"), None

    def read_mlp(self, r: WeightReader, m: str) -> tuple[Any, ...]:
        return r(m + "gate_up_proj.weight"), None, r(m + "down_proj.weight"), None
