"""OLMoE (OlmoeForCausalLM): the Llama layout with RMSNorms on q and k over all heads (weights of
[heads·head_dim], before the split into heads and RoPE) and a MoE feed-forward on every layer
(models/moe.py). Not a loader (weights.py)."""
from __future__ import annotations

from chatserve.runtime.models.decoder import DecoderModel, WeightReader
from chatserve.runtime.models.moe import MoE, read_moe


class OlmoeModel(DecoderModel):
    """config.qk_norm reads self_attn.{q,k}_norm.weight of [q_size] and [kv_size]; the loop applies them
    over whole rows (decoder._qk_norm picks by their size). Experts as Qwen-MoE names them."""

    def build_mlp(self, r: WeightReader, p: str, i: int) -> MoE | None:
        return read_moe(r, p + "mlp.", self.moe_spec, self._expert_lin, self.config.hidden_act, self.ops)
