"""Compile, before the first request, every attention kernel variant a server meets on a GPU.

Triton compiles a kernel per set of constexprs at its first launch (0.5-1 s each on an H200's host).
A server's one dummy prefill and decode meet only the unsplit variants; the first real traffic then met
6 more (split decode, the merges, narrower extend tiles) inside users' requests: TTFT p90 3.0 s against
0.17 s once warm (docs/benchmarks.md). This launches each variant once over blocks no request owns yet.
The values computed are discarded; Triton's on-disk cache makes the next start cheap.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from chatserve_kernels.decode_attention import decode_attention_triton, decode_config
from chatserve_kernels.dispatch import compute_dtype, next_pow2, tl
from chatserve_kernels.extend_attention import extend_attention_triton, extend_config, extend_tiles
from chatserve_kernels.metadata import AttentionMetadata

SPLITS = (1, 2, 5, 17)      # unsplit, then one split count per merge width (dispatch.merge_pad: 4, 16, 64)


def warm_up_attention(cache: tuple[torch.Tensor, ...], q_heads: int, q_dtype: torch.dtype,
                      windows: Iterable[int | None]) -> int:
    """Launch the decode and extend kernels' variants over `cache` (one layer's (k, v[, k_scale,
    v_scale]), [num_blocks, block_size, kv_heads, d], on CUDA), for each sliding window the model's
    layers use; variants needing more blocks than the cache has are skipped. → launches made."""
    k, v = cache[0], cache[1]
    ks, vs = (cache[2], cache[3]) if len(cache) == 4 else (None, None)
    nb, bs, hkv, d = k.shape
    dev = k.device
    fp32 = compute_dtype(q_dtype, dev) == tl.float32
    group_pad = next_pow2(q_heads // hkv)
    dec_n = decode_config(d, dev, fp32=fp32)["block_n"]
    ext = extend_config(d, group_pad, dev, fp32=fp32)
    launches = 0

    def run(query_len: int, seq_len: int) -> AttentionMetadata | None:
        blocks = -(-seq_len // bs)
        if blocks > nb:
            return None
        return AttentionMetadata.build([query_len], [seq_len], [list(range(blocks))], bs, dev)

    for window in sorted(set(windows), key=lambda w: w or 0):
        for splits in SPLITS:                                   # decode: one sequence, `splits` tiles
            meta = run(1, splits * dec_n)
            if meta is None:
                continue
            q = torch.zeros(1, q_heads, d, dtype=q_dtype, device=dev)
            decode_attention_triton(q, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                    meta.max_seq_len, d ** -0.5, torch.empty_like(q), ks, vs, window,
                                    num_splits=splits)
            launches += 1
        for block_m in extend_tiles(ext["block_m"], group_pad):  # extend: one chunk, each tile and split
            for splits in SPLITS:
                query_len = block_m
                meta = run(query_len, max(query_len, splits * ext["block_n"]))
                if meta is None:
                    continue
                for skip_decode in (False, True):
                    q = torch.zeros(query_len, q_heads, d, dtype=q_dtype, device=dev)
                    extend_attention_triton(q, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                            query_len, d ** -0.5, torch.empty_like(q), ks, vs, window,
                                            skip_decode=skip_decode, block_m=block_m, num_splits=splits,
                                            max_seq_len=meta.max_seq_len)
                    launches += 1
    return launches
