"""gpt-oss (GptOssForCausalLM): Llama-shaped attention with q/k/v/o biases, a learned sink logit per head in
every softmax (layers.Attention → paged_attention's torch twin), sliding-window and full layers
alternating (config.layer_types), YaRN RoPE, and a MoE feed-forward on every layer whose router and
experts have biases and whose experts use a clamped SwiGLU (OaiSwiGLU). Routing takes the softmax of the
top-k logits, which is the renormalized top-k of the softmax (MoESpec.norm_topk_prob).

Expert tensors: transformers' / the hub's fused form (experts.gate_up_proj [E, H, 2I] with gate and up
columns interleaved, experts.down_proj [E, I, H], both applied as x @ W, with _bias tensors), or GGUF's
stacked ones (experts.{gate,up,down}_proj.{weight,bias}, llama.cpp de-interleaved them); the hub's MXFP4
blocks arrive here already dequantized (runtime/mxfp4.py). The "harmony" chat format is not mapped onto
reasoning and tool calls here. Not a loader (weights.py)."""
from __future__ import annotations

import torch

from chatserve.runtime.models.decoder import DecoderModel, WeightReader
from chatserve.runtime.models.layers import AnyLinear, GatedMLP, Linear, RowSplit
from chatserve.runtime.models.moe import MoE, check_expert_count, dense

# one expert's (gate w [I, H], gate b [I], up w, up b, down w [H, I], down b [H])
OaiExpert = tuple[torch.Tensor, ...]


class OaiSwiGLU(GatedMLP):
    """down((clamp(up, ±limit) + 1) · g · σ(alpha · g)) with g = min(gate, limit)."""

    def __init__(self, gate_up: AnyLinear, down: AnyLinear, alpha: float, limit: float) -> None:
        self.gate_up, self.down, self.alpha, self.limit = gate_up, down, alpha, limit

    def __call__(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # x: [T, H] → [T, H]
        g, u = self.gate_up(x, rows).chunk(2, -1)                        # [T, I] each
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return self.down((u + 1) * (g * torch.sigmoid(g * self.alpha)), rows)


def read_oai_experts(r: WeightReader, p: str, n: int) -> list[OaiExpert] | None:
    """The n experts under prefix p ("…mlp.experts.") in the fused or the stacked form (module doc)."""
    if r.has(p + "gate_up_proj"):
        gu, gub = r(p + "gate_up_proj"), r(p + "gate_up_proj_bias")          # [E, H, 2I], [E, 2I]
        d, db = r(p + "down_proj"), r(p + "down_proj_bias")                  # [E, I, H], [E, H]
        if gub is None or d is None or db is None:
            return None
        for name, t in (("gate_up_proj", gu), ("gate_up_proj_bias", gub), ("down_proj", d), ("down_proj_bias", db)):
            check_expert_count(p + name, t, n)
        return [(gu[e, :, 0::2].t(), gub[e, 0::2], gu[e, :, 1::2].t(), gub[e, 1::2], d[e].t(), db[e])
                for e in range(n)]
    ts = [r(p + f"{m}_proj.{k}") for m in ("gate", "up", "down") for k in ("weight", "bias")]
    if any(t is None for t in ts):
        return None
    ts = [dense(t, r.dtype) for t in ts]          # in place, the 2-D [E, n] biases came as block matrices
    for t in ts:
        check_expert_count(p + "*_proj", t, n)
    return [tuple(t[e] for t in ts) for e in range(n)]


class GptOssModel(DecoderModel):
    def build_mlp(self, r: WeightReader, p: str, i: int) -> MoE | None:
        spec, m = self.moe_spec, p + "mlp."
        router, router_b = r(m + "router.weight"), r(m + "router.bias")       # [E, H], [E]
        experts = read_oai_experts(r, m + "experts.", spec.num_experts)
        if router is None or router_b is None or experts is None:
            return None
        assert spec.swiglu_oai is not None               # gpt-oss's config always sets it
        alpha, limit = spec.swiglu_oai
        mlps = [OaiSwiGLU(self._lin(torch.cat([gw, uw]).contiguous(), torch.cat([gb, ub])),
                          self._lin(dw.contiguous(), db), alpha, limit)
                for gw, gb, uw, ub, dw, db in experts]
        return MoE(Linear(dense(router, router_b.dtype), router_b), mlps, spec.top_k, spec.norm_topk_prob)
