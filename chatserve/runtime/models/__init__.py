"""Model families by architecture name (ArchConfig.arch, from HF model_type or GGUF general.architecture):
adding a family is its module plus one line here."""
from __future__ import annotations

import torch

from chatserve.runtime.models.decoder import DecoderModel
from chatserve.runtime.models.gemma import GemmaModel
from chatserve.runtime.models.gpt_oss import GptOssModel
from chatserve.runtime.models.linear_backends import BlockLinear, BlockMatrix, TorchBlockLinear
from chatserve.runtime.models.llama import LlamaModel
from chatserve.runtime.models.mixtral import MixtralModel
from chatserve.runtime.models.olmoe import OlmoeModel
from chatserve.runtime.models.phi3 import Phi3Model
from chatserve.runtime.models.qwen3 import Qwen3Model
from chatserve.runtime.models.qwen_moe import QwenMoeModel
from chatserve.runtime.arch_config import ArchConfig, UnsupportedModelError

FAMILIES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": Qwen3Model,
    "gemma2": GemmaModel,
    "gemma3": GemmaModel,
    "phi3": Phi3Model,
    "qwen2moe": QwenMoeModel,
    "qwen3moe": QwenMoeModel,
    "mixtral": MixtralModel,
    "olmoe": OlmoeModel,
    "gpt-oss": GptOssModel,
}


def build_model(config: ArchConfig, tensors: dict[str, torch.Tensor | BlockMatrix], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", max_model_len: int | None = None,
                weight_quant: str | None = None, fused: bool = True,
                block_backend: type[BlockLinear] = TorchBlockLinear) -> DecoderModel:
    """The family's model on these weights; an unknown arch raises UnsupportedModelError."""
    cls = FAMILIES.get(config.arch)
    if cls is None:
        raise UnsupportedModelError(f"architecture {config.arch!r} is not supported "
                                    f"(supported: {', '.join(sorted(FAMILIES))})")
    return cls(config, tensors, dtype, device, max_model_len, weight_quant, fused, block_backend)
