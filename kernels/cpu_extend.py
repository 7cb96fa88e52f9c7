"""Prefill chunks on CPU through torch's tiled flash-attention kernel, with bounded memory.

A chunk of new tokens attends to its cached prefix (every key visible) and causally to itself; torch's
CPU flash kernel masks upper-left, so the two parts run as two calls, merged by their log-sum-exps.
Nothing of size chunk × context is allocated. Not for decode rows, sliding windows or soft-capping.
"""
from __future__ import annotations

import torch

from chatserve_kernels.decode_attention import gather_dequant

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
DTYPES = (torch.float32, torch.bfloat16)


def flash_supported(q: torch.Tensor, sliding_window: int | None = None,
                    logit_softcap: float | None = None) -> bool:
    """CPU, fp32 or bf16 queries, no sliding window, no soft-capping (any cache: it is gathered
    and dequantized into q's dtype first)."""
    return (_FLASH is not None and q.device.type == "cpu" and q.dtype in DTYPES
            and not sliding_window and not logit_softcap)


def extend_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           table: torch.Tensor, seq_len: int, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # One sequence: q [ql, hq, d] at positions seq_len-ql .. seq_len-1; table [nblk] int64 → [ql, hq, d]
    # Working memory: the sequence's gathered K/V [seq_len, hkv, d] and a few [ql, hq, d] buffers;
    # torch's kernel holds one (q tile × kv tile) fp32 score block per thread.
    ql, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    ctx = seq_len - ql
    k = gather_dequant(k_cache, k_scale, table, q.dtype)[:seq_len]                 # [sl, hkv, d]
    v = gather_dequant(v_cache, v_scale, table, q.dtype)[:seq_len]
    # the chunk against itself: square, so the kernel's upper-left causal mask is the right one
    qh = q.transpose(0, 1)[None]                                                   # [1, hq, ql, d]
    ks = k[ctx:].repeat_interleave(g, 1).transpose(0, 1)[None]                     # [1, hq, ql, d]
    vs = v[ctx:].repeat_interleave(g, 1).transpose(0, 1)[None]
    assert _FLASH is not None                      # flash_supported() said so
    o_self, lse_self = _FLASH(qh, ks, vs, 0.0, True, scale=scale)                  # [1,hq,ql,d] [1,hq,ql]
    if ctx == 0:
        return o_self[0].transpose(0, 1)
    # the prefix, fully visible: a kv head's g query heads become rows of one call (K/V read once)
    qf = q.view(ql, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * ql, d)
    o_pre, lse_pre = _FLASH(qf, k[:ctx].transpose(0, 1)[None], v[:ctx].transpose(0, 1)[None], 0.0, False,
                            scale=scale)                                           # [1,hkv,g*ql,d]
    lse_pre = lse_pre.reshape(hq, ql, 1)
    lse_self = lse_self.reshape(hq, ql, 1)
    m = torch.maximum(lse_pre, lse_self)
    w_pre, w_self = (lse_pre - m).exp_(), (lse_self - m).exp_()
    o = o_pre.reshape(hq, ql, d).float().mul_(w_pre).add_(o_self[0].float().mul_(w_self))
    return o.div_(w_pre.add_(w_self)).to(q.dtype).transpose(0, 1)                  # [ql, hq, d]
