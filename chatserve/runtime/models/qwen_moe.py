"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): the Qwen2 /
Qwen3 attention (q/k/v biases / per-head q and k norms, from the config) with MoE feed-forward layers
(models/moe.py) where decoder_sparse_step and mlp_only_layers put them, dense MLPs elsewhere; Qwen2-MoE
adds a shared expert gated by sigmoid(x·g). Not a loader (weights.py)."""
from __future__ import annotations

from chatserve.runtime.models.decoder import DecoderModel, WeightReader
from chatserve.runtime.models.layers import GatedMLP
from chatserve.runtime.models.moe import MoE, read_moe


class QwenMoeModel(DecoderModel):
    """mlp.gate.weight [E, H], mlp.experts.{e}.{gate,up,down}_proj.weight, mlp.shared_expert.*."""

    def build_mlp(self, r: WeightReader, p: str, i: int) -> GatedMLP | MoE | None:
        if not self.moe_spec.sparse_layers[i]:
            return super().build_mlp(r, p, i)
        return read_moe(r, p + "mlp.", self.moe_spec, self._expert_lin, self.config.hidden_act, self.ops)
