"""Mixtral (MixtralForCausalLM): the Mistral layout (optional sliding window on every layer) with a MoE
feed-forward on every layer (models/moe.py), the router's top-k weights always renormalized. Tensors
as the hub names them (block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1/w3/w2: gate/up/down) or
transformers' own (mlp.gate, mlp.experts.*). Not a loader (weights.py)."""
from __future__ import annotations

from chatserve.runtime.models.decoder import DecoderModel, WeightReader
from chatserve.runtime.models.moe import MoE, read_moe


class MixtralModel(DecoderModel):
    def build_mlp(self, r: WeightReader, p: str, i: int) -> MoE | None:
        c = self.config
        if r.has(p + "mlp.gate.weight"):
            return read_moe(r, p + "mlp.", self.moe_spec, self._expert_lin, c.hidden_act, self.ops)
        return read_moe(r, p + "block_sparse_moe.", self.moe_spec, self._expert_lin, c.hidden_act, self.ops,
                        names=("w1", "w3", "w2"))
