"""Prefix-aware prefill ("extend") attention: a chunk of new tokens against its cached prefix and itself.

The chunk's own K/V are already in the paged cache (store_kv runs first), so each query tile streams
its sequence's blocks with an online softmax (FlashAttention style) under a causal mask. Not for decode.
"""
from __future__ import annotations

import torch

from chatserve_kernels.decode_attention import (attend_blocks, check_paged_args, gather_dequant, merge_splits,
                                                paged_kernel_args, sink_softmax, softcap, take_blocks)
from chatserve_kernels.dispatch import (cdiv, compute_dtype, device_sms, dot_precision, jit, merge_pad, next_pow2,
                                        tl)


# --------------------------------------------------------------------------- Triton kernel
@jit(do_not_specialize=("window", "tokens_per_split", "num_splits", "stride_bt"))
def _extend_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, qsl_ptr,
                   sm_scale_log2, window, tokens_per_split, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, stride_bt,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_MODE: tl.constexpr,
                   COMPUTE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                   SKIP_DECODE: tl.constexpr, SPLIT: tl.constexpr):
    # grid: (batch, kv_heads, query tiles × splits). One program: BLOCK_M new tokens × the GROUP query
    # heads of one kv head, as ROWS = BLOCK_M * GROUP_PAD rows (row r = token r // GROUP_PAD, head
    # r % GROUP_PAD), over the keys of its split (SPLIT: keys [s·tokens_per_split, (s+1)·...), written
    # as partials that _extend_merge_kernel combines; short chunks over long prefixes get programs).
    #
    #   keys:  0 ............ ctx-1 | ctx ........ seq_len-1      (ctx = cached prefix length)
    #   query i of the chunk sits at position ctx + i and sees keys 0 .. ctx + i
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    mt = tl.program_id(2) // num_splits
    sp = tl.program_id(2) % num_splits
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    if SKIP_DECODE:
        q_len = tl.where(q_len == 1, 0, q_len)          # decode rows are the decode kernel's job

    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    r = tl.arange(0, ROWS)
    m = mt * BLOCK_M + r // GROUP_PAD                                         # token index in chunk
    g = r % GROUP_PAD
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    row_ok = (m < q_len) & (g < GROUP)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)  # q: [ROWS, D_PAD]
    qpos = ctx + m                                                            # [ROWS]
    first = mt * BLOCK_M
    last = tl.minimum(q_len, first + BLOCK_M) - 1
    hi = tl.where(first < q_len, ctx + last + 1, 0)                          # keys [lo, hi) are needed
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx + first - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, sp * tokens_per_split)
        hi = tl.minimum(hi, (sp + 1) * tokens_per_split)
    o, lse = attend_blocks(q, lo, hi, qpos, window, block_tables_ptr + b * stride_bt, kvh,
                           k_ptr, v_ptr, ks_ptr, vs_ptr, sm_scale_log2,
                           stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                           ROWS, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SCALE_MODE, COMPUTE,
                           PRECISION, True, WINDOW)                              # o: [ROWS, D_PAD]
    if SPLIT:
        # partials: o [T, NUM_Q_HEADS, num_splits, D_PAD], lse (log2 domain) [T, NUM_Q_HEADS, num_splits]
        prow = ((q_start + m) * NUM_Q_HEADS + heads) * num_splits + sp                    # [ROWS]
        tl.store(part_o_ptr + prow[:, None] * D_PAD + d[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + prow, lse, mask=row_ok)
    else:
        tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@jit(do_not_specialize=("num_splits",))
def _extend_merge_kernel(out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, num_splits, stride_ot, stride_oh,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         S_PAD: tl.constexpr, SKIP_DECODE: tl.constexpr):
    # grid: (batch, q_heads, max query len): the partials of one token and head of a split launch
    # out = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if SKIP_DECODE:
        q_len = tl.where(q_len == 1, 0, q_len)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = (s < num_splits) & ((s * 0 + i) < q_len)
    res = merge_splits(part_o_ptr, part_lse_ptr, ((q_start + i) * NUM_Q_HEADS + h) * num_splits + s, s_ok,
                       D_PAD)                                                               # [D_PAD]
    ok = (d < HEAD_DIM) & ((d * 0 + i) < q_len)
    tl.store(out_ptr + (q_start + i) * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- launcher
def extend_config(head_dim: int, group_pad: int, device: torch.device, fp32: bool = False) -> dict:
    """Tile sizes: BLOCK_M query tokens (so BLOCK_M × padded group ≈ 32–128 rows), BLOCK_N keys.

    Compiled for sm_90 without a GPU: bf16/fp16/int8/fp8 with 128 rows and 8 warps use ~200-230
    registers without spilling; fp32 (FMA dots) needs 32 rows × 32 keys (8 warps at d 128).
    """
    if device.type != "cuda":
        rows, cfg = 32, {"block_n": 32, "num_stages": 1}
    elif fp32:
        rows, cfg = 32, {"block_n": 32, "num_stages": 1}
    else:
        rows, cfg = 128, {"block_n": 64, "num_stages": 2}
    block_m = max(1, min(64, rows // group_pad))
    if block_m * group_pad < 16:
        block_m = 16 // group_pad
    return {"block_m": block_m, **cfg}


def extend_num_warps(rows: int, head_dim: int, fp32: bool) -> int:
    """8 warps once a tile holds ≥ 8192 accumulator values (fp32 dots count double), else 4."""
    return 8 if rows * head_dim * (2 if fp32 else 1) >= 8192 else 4


def extend_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                            out: torch.Tensor, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                            skip_decode: bool = False, block_m: int | None = None,
                            block_n: int | None = None, num_splits: int | None = None,
                            max_seq_len: int | None = None) -> torch.Tensor:
    # q, out: [T, q_heads, D]; k_cache, v_cache: [NB, BS, kv_heads, D]; block_tables: [B, max_blocks];
    # seq_lens: [B]; query_start_loc: [B+1]. skip_decode leaves rows of 1-token sequences untouched.
    # num_splits: cut every sequence's keys into this many splits (default: choose_extend_splits from
    # max_seq_len, the host copy of max(seq_lens); without it, no split).
    T, hq, D = q.shape
    nb, bs, hkv, dc = k_cache.shape
    B = seq_lens.shape[0]
    mode, sstr = check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                                  k_scale, v_scale)
    if B == 0 or max_query_len == 0:
        return out
    group = hq // hkv
    group_pad = next_pow2(group)
    compute = compute_dtype(q.dtype, q.device)
    cfg = extend_config(D, group_pad, q.device, fp32=compute == tl.float32)
    if block_m is None:
        # few programs (one long chunk, few kv heads): smaller query tiles, so every SM gets work
        sizes = extend_tiles(cfg["block_m"], group_pad)
        block_m = next((m for m in sizes if B * hkv * cdiv(max_query_len, m) >= device_sms(q.device)), sizes[-1])
    block_n = block_n or cfg["block_n"]
    assert block_m * group_pad >= 16, "tl.dot needs at least 16 rows"
    tiles = cdiv(max_query_len, block_m)
    if num_splits is None:
        num_splits = choose_extend_splits(B * hkv * tiles, max_seq_len or 0, max_query_len, q.device)
    tps = cdiv(cdiv(max_seq_len or 1, num_splits), block_n) * block_n if num_splits > 1 else 1
    if num_splits > 1 and max_seq_len is None:
        raise ValueError("num_splits > 1 needs max_seq_len")
    split = num_splits > 1
    d_pad = next_pow2(D)
    args, partials = paged_kernel_args(q, k_cache, v_cache, k_scale, v_scale, out, block_tables,
                                       seq_lens, query_start_loc, scale, sliding_window, tps, num_splits, sstr,
                                       rows=T)
    grid = (B, hkv, tiles * num_splits)
    _extend_kernel[grid](
        *args,
        NUM_Q_HEADS=hq, GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=D, D_PAD=d_pad,
        BLOCK_SIZE=bs, BLOCK_N=block_n, SCALE_MODE=mode, COMPUTE=compute,
        PRECISION=dot_precision(compute), WINDOW=bool(sliding_window), SKIP_DECODE=skip_decode,
        SPLIT=split, num_warps=extend_num_warps(block_m * group_pad, D, compute == tl.float32),
        num_stages=cfg["num_stages"],
    )
    if split:
        _extend_merge_kernel[(B, hq, max_query_len)](
            out, *partials, query_start_loc, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=D, D_PAD=d_pad, S_PAD=merge_pad(num_splits), SKIP_DECODE=skip_decode,
            num_warps=4,
        )
    return out


def extend_tiles(block_m: int, group_pad: int) -> list[int]:
    """The query tiles extend_attention_triton may pick (the warm-up compiles each): the config's, then
    halved while the tile holds more than 16 rows (few programs: one short chunk over few kv heads)."""
    tiles = [block_m]
    while tiles[-1] * group_pad > 16:
        tiles.append(tiles[-1] // 2)
    return tiles


def choose_extend_splits(programs: int, max_seq_len: int, max_query_len: int, device: torch.device,
                         min_tokens: int = 512, max_query: int = 256, max_splits: int = 32) -> int:
    """Split the keys of short chunks (<= max_query tokens) over long prefixes when the query tiles
    alone give fewer than 2 programs per SM (a follow-up turn after 16k tokens of history: kv_heads
    programs); no split shorter than min_tokens keys."""
    if max_query_len > max_query or max_seq_len < 2 * min_tokens:
        return 1
    want = cdiv(2 * device_sms(device), max(programs, 1))
    return max(1, min(want, max_seq_len // min_tokens, max_splits))


# --------------------------------------------------------------------------- torch twin
def extend_prep(block_table: torch.Tensor, seq_len: int, query_len: int, block_size: int,
                sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step and sequence, shared by the layers: (table [nblk] int64, causal bias [ql, sl] float32:
    0 where a key is visible, -inf where it is not)."""
    nblk = (seq_len + block_size - 1) // block_size
    table = block_table[:nblk].long()
    qpos = torch.arange(seq_len - query_len, seq_len, device=block_table.device)[:, None]
    kpos = torch.arange(seq_len, device=block_table.device)[None, :]
    visible = kpos <= qpos                                                    # [ql, sl]
    if sliding_window:
        visible &= (qpos - kpos) < sliding_window
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return table, bias.masked_fill_(~visible, float("-inf"))


SCORE_ELEMS = 1 << 24    # fp32 scores held at once (64 MiB): longer contexts run in query slices


def extend_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor | None, seq_len: int, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None,
                           prep: tuple[torch.Tensor, torch.Tensor] | None = None,
                           logit_softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    # One sequence: q [ql, q_heads, D] for positions seq_len-ql .. seq_len-1 → [ql, q_heads, D]
    # prep: extend_prep(...) of this step (built here when None); logit_softcap: s → c·tanh(s / c);
    # sinks: [q_heads] float32 (decode_attention.sink_softmax).
    # Two batched GEMMs per KV head group (the query heads of a group stacked as rows) around an fp32
    # softmax: on CPU, SDPA with a mask takes its math path, ~4× slower in bf16 on a 512-token chunk.
    ql, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    if prep is None:
        assert block_table is not None, "the block table, or the prep built from it"
        prep = extend_prep(block_table, seq_len, ql, k_cache.shape[1], sliding_window)
    table, bias = prep
    kt = gather_dequant(k_cache, k_scale, table, q.dtype)[:seq_len].permute(1, 2, 0)  # [hkv, d, sl]
    v = gather_dequant(v_cache, v_scale, table, q.dtype)[:seq_len].transpose(0, 1)    # [hkv, sl, d]
    out = torch.empty_like(q)
    sk = None if sinks is None else sinks.view(hkv, g, 1, 1)
    step = max(1, SCORE_ELEMS // (hq * seq_len))
    for a in range(0, ql, step):
        z = min(ql, a + step)
        qg = (q[a:z] * scale).view(z - a, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * (z - a), d)
        s = softcap(torch.matmul(qg, kt).view(hkv, g, z - a, seq_len), logit_softcap)  # [hkv, g, m, sl]
        s = s.add_(bias[a:z]) if s.dtype == torch.float32 else torch.add(bias[a:z], s)   # fp32 scores
        p = sink_softmax(s, sk).to(q.dtype).view(hkv, g * (z - a), seq_len)
        o = torch.matmul(p, v)                                                      # [hkv, g*m, d]
        out[a:z] = o.view(hkv, g, z - a, d).permute(2, 0, 1, 3).reshape(z - a, hq, d)
    return out


BATCH_MAX_QUERY = 64     # chunks of up to this many new tokens share one padded batch (below)


def extend_batch_prep(block_tables: torch.Tensor, starts: list[int], query_lens: list[int],
                      seq_lens: list[int], block_size: int, sliding_window: int | None = None) -> tuple:
    """Short chunks of several sequences as one padded batch, built once per step.

    block_tables: [B, w] of those sequences; starts: their first row in the step's q. Returns
    (q index [B, m] into q's rows (padding → the chunk's first row), table [B, nblk] int64 (padding →
    block 0), bias [B, 1, 1, m, S] float32 (0 visible, -inf not), rows [n]: their rows in q, picks [n]:
    the same rows in the flattened [B*m] batch)."""
    dev = block_tables.device
    m = max(query_lens)
    nblk = (max(seq_lens) + block_size - 1) // block_size
    S = nblk * block_size
    i = torch.arange(m, device=dev)
    start_t = torch.tensor(starts, device=dev)[:, None]
    ql_t = torch.tensor(query_lens, device=dev)[:, None]
    sl_t = torch.tensor(seq_lens, device=dev)[:, None]
    real = i[None, :] < ql_t                                                   # [B, m]
    qidx = torch.where(real, start_t + i[None, :], start_t)
    table = block_tables[:, :nblk].long() * (torch.arange(nblk, device=dev)[None, :] * block_size
                                             < sl_t).long()
    qpos = (sl_t - ql_t + i[None, :])[:, :, None]                             # [B, m, 1]
    kpos = torch.arange(S, device=dev)[None, None, :]
    visible = (kpos <= qpos) & (kpos < sl_t[:, :, None])
    if sliding_window:
        visible &= (qpos - kpos) < sliding_window
    visible |= ~real[:, :, None] & (kpos == 0)        # padding rows see one key: no all -inf softmax
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=dev).masked_fill_(~visible, float("-inf"))
    rows = torch.cat([torch.arange(s, s + ql, device=dev) for s, ql in zip(starts, query_lens)])
    picks = real.reshape(-1).nonzero()[:, 0]
    return qidx, table, bias[:, None, None], rows, picks


def extend_batch_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                       prep: tuple, logit_softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The chunks of extend_batch_prep, attended together: the same two GEMMs as
    extend_attention_torch with a batch dim, so a step's short chunks (prefix-cache hits, chat turns)
    cost one set of ops per layer instead of one per sequence. Unquantized caches only.

    q: [T, q_heads, D] (the whole step) → [n, q_heads, D]: the outputs of prep's rows, in order."""
    qidx, table, bias, _, picks = prep
    B, m = qidx.shape
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    g = hq // hkv
    S = table.shape[1] * k_cache.shape[1]
    qg = (q[qidx.reshape(-1)] * scale).view(B, m, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(B, hkv, g * m, d)
    k = take_blocks(k_cache, table).view(B, S, hkv, d).permute(0, 2, 3, 1)    # [B, hkv, d, S]
    v = take_blocks(v_cache, table).view(B, S, hkv, d).transpose(1, 2)        # [B, hkv, S, d]
    s = torch.add(bias, softcap(torch.matmul(qg, k).view(B, hkv, g, m, S), logit_softcap))  # fp32 [B,hkv,g,m,S]
    p = sink_softmax(s, None if sinks is None else sinks.view(1, hkv, g, 1, 1)).to(q.dtype).view(B, hkv, g * m, S)
    o = torch.matmul(p, v).view(B, hkv, g, m, d).permute(0, 3, 1, 2, 4).reshape(B * m, hq, d)
    return o[picks]
