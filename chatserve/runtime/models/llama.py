"""Llama family: Llama 2/3.x (attention_bias on q/k/v/o, mlp_bias), Mistral (sliding window), Qwen2/2.5
(q/k/v bias) and SmolLM2: the plain DecoderModel with HF tensor names.

Not a loader (weights.py) and not the shared layers (layers.py, decoder.py).
"""
from __future__ import annotations

from chatserve.runtime.models.decoder import DecoderModel


class LlamaModel(DecoderModel):
    """Every switch off: pre-norm, SwiGLU, separate q/k/v/gate/up tensors fused at load."""
