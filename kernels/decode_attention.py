"""Paged decode attention: one query token per sequence against its paged K/V, split-K over the context.

All query heads that share a KV head run in one program (the GQA group, padded to 16 rows for tl.dot);
long contexts are cut into splits merged by log-sum-exp. Not for prefill chunks (extend_attention is).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from chatserve_kernels.dispatch import (cdiv, compute_dtype, device_sms, dot_precision, jit, merge_pad, next_pow2,
                                        tl)
from chatserve_kernels.quant import SCALE_TOKEN, dequantize_torch, scale_mode

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- Triton kernels
@jit(do_not_specialize=("window", "tokens_per_split", "num_splits", "stride_bt"))
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, qsl_ptr,
                   sm_scale_log2, window, tokens_per_split, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, stride_bt,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SCALE_MODE: tl.constexpr, COMPUTE: tl.constexpr,
                   PRECISION: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr):
    # grid: (batch, kv_heads, splits). Program (b, kvh, s) covers tokens [lo, hi) of sequence b.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    seq_len = tl.where(q_len == 1, seq_len, 0)          # rows that are not decode rows do nothing
    lo = s * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)
    if WINDOW:
        lo = tl.maximum(lo, seq_len - window)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g                                                   # [GROUP_PAD]
    q = tl.load(q_ptr + q_start * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)   # q: [GROUP_PAD, D_PAD]
    o, lse = attend_blocks(q, lo, hi, 0, 0, block_tables_ptr + b * stride_bt, kvh,
                           k_ptr, v_ptr, ks_ptr, vs_ptr, sm_scale_log2,
                           stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                           GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SCALE_MODE, COMPUTE,
                           PRECISION, False, False)                              # o: [GROUP_PAD, D_PAD]
    if SPLIT:
        # partials: o [B, NUM_Q_HEADS, num_splits, D_PAD], lse (log2 domain) [B, NUM_Q_HEADS, num_splits]
        row = (b * NUM_Q_HEADS + heads) * num_splits + s                      # [GROUP_PAD]
        tl.store(part_o_ptr + row[:, None] * D_PAD + d[None, :], o, mask=g_ok[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_ok)
    else:
        row_ok = g_ok & ((g * 0 + q_len) == 1)
        tl.store(out_ptr + q_start * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@jit
def attend_blocks(q, lo, hi, qpos, window, table, kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, sm_scale_log2,
                  stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_MODE: tl.constexpr,
                  COMPUTE: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr):
    # q [ROWS, D_PAD] (COMPUTE) against keys [lo, hi) of one kv head, read through the sequence's block
    # `table`, by online softmax (log2 domain) → (o [ROWS, D_PAD] fp32 normalized, lse [ROWS] log2;
    # -inf for a row that saw no key). CAUSAL: row r sees keys <= qpos[r] (and, WINDOW, within
    # `window` of it); otherwise every row sees all of [lo, hi). The decode and extend kernels share it.
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    qk_scale = sm_scale_log2
    if SCALE_MODE == 2:
        qk_scale = qk_scale * tl.load(ks_ptr)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)                                  # token positions
        n_ok = (offs >= lo) & (offs < hi)
        blk = tl.load(table + offs // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        tok = offs % BLOCK_SIZE
        kv_off = blk * stride_cb + tok * stride_ct + kvh * stride_ch          # [BLOCK_N]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        qk = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=PRECISION)   # [ROWS, BLOCK_N]
        if SCALE_MODE == 1:
            sc_off = blk * stride_sb + tok * stride_st + kvh * stride_sh
            qk = qk * tl.load(ks_ptr + sc_off, mask=n_ok, other=0.0)[None, :]
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs[None, :] <= qpos[:, None])
            if WINDOW:
                visible = visible & ((qpos[:, None] - offs[None, :]) < window)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if SCALE_MODE == 1:
            p = p * tl.load(vs_ptr + sc_off, mask=n_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v.to(COMPUTE), input_precision=PRECISION)
        m_i = m_new
    if SCALE_MODE == 2:
        acc = acc * tl.load(vs_ptr)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    return acc / l_safe[:, None], lse


@jit
def merge_splits(part_o_ptr, part_lse_ptr, row, s_ok, D_PAD: tl.constexpr):
    # one (token, head)'s split partials at rows `row` [S_PAD] (o: [.., D_PAD], lse in log2), valid
    # where s_ok → Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M), M = max_s lse_s: [D_PAD]
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))        # [S_PAD]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    d = tl.arange(0, D_PAD)
    o = tl.load(part_o_ptr + row[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    return tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)


@jit(do_not_specialize=("num_splits",))
def _merge_kernel(out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, num_splits, stride_ot, stride_oh,
                  NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  S_PAD: tl.constexpr):
    # grid: (batch, q_heads). out = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    res = merge_splits(part_o_ptr, part_lse_ptr, (b * NUM_Q_HEADS + h) * num_splits + s, s_ok, D_PAD)
    ok = (d < HEAD_DIM) & ((d * 0 + q_len) == 1)
    tl.store(out_ptr + q_start * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- launcher
def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     out: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> tuple[int, tuple[int, int, int]]:
    """The layout both paged-attention launchers need, asserted → (scale mode, the per-token scales'
    strides: block, token, head; zeros unless the scales are per token)."""
    T, hq, D = q.shape
    nb, bs, hkv, dc = k_cache.shape
    B = seq_lens.shape[0]
    assert dc == D and hq % hkv == 0 and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    assert q.stride(2) == 1 and out.stride(2) == 1 and out.shape == q.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches need one dense layout"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.stride(1) == 1
    assert query_start_loc.shape == (B + 1,) and bs & (bs - 1) == 0, (query_start_loc.shape, bs)
    mode = scale_mode(k_cache, k_scale)
    assert scale_mode(v_cache, v_scale) == mode
    if mode != SCALE_TOKEN:
        return mode, (0, 0, 0)
    assert k_scale is not None and v_scale is not None and v_scale.stride() == k_scale.stride()
    n_blocks_stride, token_stride, head_stride = k_scale.stride()      # [NB, BS, H]
    return mode, (n_blocks_stride, token_stride, head_stride)


def paged_kernel_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, out: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float, sliding_window: int | None, tokens_per_split: int, num_splits: int,
                      sstr: tuple[int, int, int], rows: int) -> tuple[tuple, tuple]:
    """(the positional arguments the decode and extend kernels share: pointers, scalars, strides;
    the split partials they write, allocated when num_splits > 1: o [rows, q_heads, splits, D_PAD]
    and lse [rows, q_heads, splits] in fp32, rows being sequences or tokens)."""
    hq, d_pad = q.shape[1], next_pow2(q.shape[2])
    if num_splits > 1:
        part_o = torch.empty((rows, hq, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out                                               # unused
    dummy = k_cache                                                           # unquantized: no scales
    return (q, k_cache, v_cache, k_scale if k_scale is not None else dummy,
            v_scale if v_scale is not None else dummy, out, part_o, part_lse,
            block_tables, seq_lens, query_start_loc,
            scale * LOG2E, int(sliding_window or 0), tokens_per_split, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), sstr[0], sstr[1], sstr[2],
            block_tables.stride(0)), (part_o, part_lse)


def decode_config(head_dim: int, device: torch.device, fp32: bool = False) -> dict:
    """Tile sizes for the decode kernel (BLOCK_N tokens per iteration, warps, pipeline stages).

    Checked by compiling for sm_90 without a GPU: fp16/bf16 at these sizes use 80-150 registers and
    do not spill; fp32 dots run on FMA units and need the smaller tile to stay in registers.
    """
    if device.type != "cuda":
        return {"block_n": 32, "num_warps": 4, "num_stages": 1}
    if fp32:
        return {"block_n": 32, "num_warps": 4, "num_stages": 2}
    return {"block_n": 64 if head_dim > 64 else 128, "num_warps": 4, "num_stages": 2}


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device,
                      min_tokens: int = 256, max_splits: int = 64) -> int:
    """Enough splits for ~2 programs per SM, none shorter than `min_tokens` tokens."""
    programs = batch * kv_heads
    want = cdiv(2 * device_sms(device), max(programs, 1))
    return max(1, min(want, cdiv(max_seq_len, min_tokens), max_splits))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, max_seq_len: int, scale: float,
                            out: torch.Tensor, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                            num_splits: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    # q, out: [T, q_heads, head_dim]; k_cache, v_cache: [NB, BS, kv_heads, head_dim]
    # block_tables: [B, max_blocks] int32; seq_lens: [B] int32; query_start_loc: [B+1] int32.
    # Writes out[query_start_loc[b]] for every b with exactly one query token; other rows are untouched.
    T, hq, D = q.shape
    nb, bs, hkv, dc = k_cache.shape
    B = seq_lens.shape[0]
    mode, sstr = check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                                  k_scale, v_scale)
    if B == 0 or max_seq_len == 0:
        return out
    compute = compute_dtype(q.dtype, q.device)
    cfg = decode_config(D, q.device, fp32=compute == tl.float32)
    block_n = block_n or cfg["block_n"]
    splits = num_splits or choose_num_splits(B, hkv, max_seq_len, q.device)
    tps = cdiv(cdiv(max_seq_len, splits), block_n) * block_n                 # tokens per split
    splits = cdiv(max_seq_len, tps)
    group = hq // hkv
    d_pad = next_pow2(D)
    split = splits > 1
    args, partials = paged_kernel_args(q, k_cache, v_cache, k_scale, v_scale, out, block_tables,
                                       seq_lens, query_start_loc, scale, sliding_window, tps, splits, sstr,
                                       rows=B)
    _decode_kernel[(B, hkv, splits)](
        *args,
        NUM_Q_HEADS=hq, GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=D, D_PAD=d_pad,
        BLOCK_SIZE=bs, BLOCK_N=block_n, SCALE_MODE=mode, COMPUTE=compute,
        PRECISION=dot_precision(compute), SPLIT=split, WINDOW=bool(sliding_window),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    if split:
        _merge_kernel[(B, hq)](
            out, *partials, query_start_loc, splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=D, D_PAD=d_pad, S_PAD=merge_pad(splits), num_warps=4,
        )
    return out


# --------------------------------------------------------------------------- torch twin
def take_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [NB, ...] at int64 table [...] → [..., *cache.shape[1:]]: one index_select over a flat
    [NB, row] view (a memcpy per block; advanced indexing is slower per decode layer on CPU)."""
    nb = cache.shape[0]
    flat = cache.view(torch.uint8) if cache.dtype.itemsize == 1 and cache.is_floating_point() else cache
    rows = flat.reshape(nb, -1).index_select(0, table.reshape(-1))          # [n, row] (fp8 as raw bytes)
    rows = rows.view(cache.dtype) if rows.dtype != cache.dtype else rows
    return rows.view(*table.shape, *cache.shape[1:])


def gather_dequant(cache: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """cache [NB, BS, H, D] at table [..., n] → [..., n*BS, H, D] of `dtype` (dequantized if needed)."""
    blocks = take_blocks(cache, table)                                        # [..., n, BS, H, D]
    if scale is not None and scale.dim() == 3:
        vals = dequantize_torch(blocks, take_blocks(scale, table), dtype)
    else:
        vals = dequantize_torch(blocks, scale, dtype)
    return vals.flatten(-4, -3)


def softcap(s: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2): s → cap·tanh(s / cap) in float32; s itself when unset."""
    return s if not cap else torch.tanh(s.float() / cap).mul_(cap)


def sink_softmax(s: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 scores; with sinks (gpt-oss: one learned logit per head,
    shaped to broadcast against s) each row's denominator also holds e^sink: p_j = e^s_j / (e^sink + Σ e^s_i)."""
    if sinks is None:
        return torch.softmax(s, -1)
    mx = torch.maximum(s.amax(-1, keepdim=True), sinks)
    e = torch.exp(s - mx)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sinks - mx))


def decode_prep(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, block_size: int,
                sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What every layer's decode attention needs, built once per step: (table [B, nblk] int64,
    mask [B, 1, 1, nblk*bs] bool: True where a key is visible)."""
    nblk = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:, :nblk].long()                                     # [B, nblk]
    pos = torch.arange(nblk * block_size, device=block_tables.device)[None, :]
    lens = seq_lens.to(device=pos.device, dtype=pos.dtype)[:, None]
    mask = pos < lens                                                         # [B, S]
    if sliding_window:
        mask &= pos >= lens - sliding_window
    return table, mask[:, None, None, :]


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None,
                           prep: tuple[torch.Tensor, torch.Tensor] | None = None,
                           logit_softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [B, q_heads, D] (one token per sequence) → [B, q_heads, D]; sinks: [q_heads] float32 (sink_softmax)
    # Every sequence's blocks are gathered, padded to the longest, and the tail masked: one SDPA call.
    # prep: decode_prep(...) of this step, shared by the layers (built here when None).
    B, hq, d = q.shape
    hkv = k_cache.shape[2]
    if prep is None:
        prep = decode_prep(block_tables, seq_lens, max_seq_len, k_cache.shape[1], sliding_window)
    table, mask = prep
    # a 16-bit cache is attended in its own dtype (no upcast copy of the gathered K/V)
    cd = k_cache.dtype if k_cache.dtype in (torch.bfloat16, torch.float16) else q.dtype
    k = gather_dequant(k_cache, k_scale, table, cd).transpose(1, 2)           # [B, hkv, nblk*bs, d]
    v = gather_dequant(v_cache, v_scale, table, cd).transpose(1, 2)
    if logit_softcap or sinks is not None:  # SDPA has neither: the scores spelled out, in fp32
        qg = (q.float() * scale).view(B, hkv, hq // hkv, d)
        s = softcap(torch.matmul(qg, k.float().transpose(2, 3)), logit_softcap)  # [B, hkv, g, S]
        sk = None if sinks is None else sinks.view(1, hkv, hq // hkv, 1)
        p = sink_softmax(s.masked_fill_(~mask, float("-inf")), sk)
        return torch.matmul(p, v.float()).view(B, hq, d).to(q.dtype)
    out = F.scaled_dot_product_attention(q[:, :, None, :].to(cd), k, v, attn_mask=mask,
                                         scale=scale, enable_gqa=hq != hkv)   # [B, hq, 1, d]
    return out[:, :, 0, :].to(q.dtype)
