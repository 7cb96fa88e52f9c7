"""MXFP4 weights as gpt-oss's hub checkpoint stores its experts (OCP microscaling FP4): `<name>_blocks`
[..., N, G, 16] uint8, two e2m1 codes a byte (low nibble first), 32 values a group, and `<name>_scales`
[..., N, G] uint8, one e8m0 exponent a group (2^(s - 127)), dequantized once at load into the dense
[..., K, N] tensor `<name>` that transformers' gpt-oss holds (applied as x @ W).

Not a kernel (nothing runs in FP4) and not a loader (weights.py calls fold_mxfp4).
"""
from __future__ import annotations

import torch

SUFFIXES = ("_blocks", "_scales")
# the 16 e2m1 values by code: sign bit 3, then exponent and mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., N, G, 16] uint8, scales [..., N, G] uint8 → [..., K = 32·G, N] in dtype, one leading
    index (expert) at a time so the float32 intermediate stays one expert's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} / scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected [..., N, G, 16] and [..., N, G] uint8")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    *lead, N, G, _ = blocks.shape
    b, s = blocks.reshape(-1, N, G, 16), scales.reshape(-1, N, G)
    out = torch.empty(b.shape[0], 32 * G, N, dtype=dtype)
    for e in range(b.shape[0]):
        codes = torch.stack([b[e] & 15, b[e] >> 4], -1).long()                  # [N, G, 16, 2]
        vals = lut[codes].flatten(-2)                                             # [N, G, 32]
        vals = torch.ldexp(vals, s[e].to(torch.int32)[..., None] - 127)
        out[e] = vals.reshape(N, 32 * G).t().to(dtype)                          # [K, N]
    return out.reshape(*lead, 32 * G, N)


def fold_mxfp4(raw: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each `<name>_blocks` + `<name>_scales` pair of raw → `<name>` dense; a piece without its pair is
    returned under its own name, in dtype (the exact load then names it)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        base = name[:-len("_blocks")]
        if name.endswith("_blocks") and base + "_scales" in raw:
            out[base] = dequantize_mxfp4(t, raw[base + "_scales"], dtype)
        elif not (name.endswith("_scales") and name[:-len("_scales")] + "_blocks" in raw):
            out[name] = t.to(dtype)
    return out
