"""The CPU path of paged attention: cpu_attention.c, compiled at first use, called via ctypes.

Every query row (decode rows and prefill chunks alike) against its sequence's K/V, read from the
blocks in place (the torch twin gathers a padded copy per layer, then runs SDPA). Batch-invariant: a
row's bits depend on its own query and keys only (cpu_attention.c says how). Where it has no compiler,
or the tensors are not its own (quantized caches, fp16, a q dtype other than the cache's), the twin
runs. CHATSERVE_CPU_KERNELS=0 turns it off.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from chatserve_kernels import cpu_build
from chatserve_kernels.metadata import AttentionMetadata

SOURCE = Path(__file__).with_name("cpu_attention.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def c_paged_attention():
    """The compiled paged attention (a ctypes function), or None where it cannot be built or is switched off."""
    return _bind(cpu_build.load(SOURCE))


AVX2_ONLY = "#define CHATSERVE_AVX2_ONLY 1\n"


@functools.lru_cache(maxsize=1)
def avx2_paged_attention():
    """The paged attention built with its AVX2 body even on an AVX-512 CPU (for the tests: every AVX2 CPU
    checks that level), or None where the CPU lacks AVX2/FMA or it cannot be built."""
    if not {"avx2", "fma"} <= cpu_build.cpu_flags():
        return None
    fn = _bind(cpu_build.load(cpu_build.composed_source("cpu_attention_avx2", AVX2_ONLY + SOURCE.read_text())))
    return fn if fn is not None and fn.level() == 2 else None


def _bind(lib):
    """lib's chatserve_paged_attention with its ctypes signature (fn.level(): the body level it runs:
    3 AVX-512, 2 AVX2, 0 generic), or None for no lib."""
    if lib is None:
        return None
    lib.chatserve_attention_level.restype = _i32
    lib.chatserve_attention_level.argtypes = []
    fn = lib.chatserve_paged_attention
    fn.level = lib.chatserve_attention_level
    fn.restype = _i32
    fn.argtypes = [_i32, _vp, _i64, _i64, _vp, _vp, _i64, _vp, _i64, _vp, _vp,
                   _i32, _i32, _i32, _i32, _i32, ctypes.c_float, _i32, ctypes.c_float, _vp, _vp, _i64, _i64, _i32]
    return fn


def available() -> bool:
    return c_paged_attention() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_scale: torch.Tensor | None = None) -> bool:
    """fp32 or bf16 (q and cache alike), an unquantized contiguous cache, head_dim <= 256,
    block_size a power of two <= 64, q_heads <= 128."""
    return (q.device.type == "cpu" and k_scale is None and q.dtype == k_cache.dtype == v_cache.dtype
            and q.dtype in _DTYPES and q.stride(-1) == 1 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and q.shape[2] <= 256 and q.shape[1] <= 128
            and k_cache.shape[1] in (1, 2, 4, 8, 16, 32, 64) and k_cache.shape[2] * k_cache.shape[3] <= 4096)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, out: torch.Tensor,
                        sliding_window: int | None = None, logit_softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> bool:
    """Write every row of out: softmax(q kᵀ · scale) v over each row's visible keys (sinks: [q_heads]
    float32 logits in every row's denominator, gpt-oss).

    q, out: [T, q_heads, D]; caches [num_blocks, block_size, kv_heads, D]. Returns False (nothing
    written) when the kernel is unavailable or cannot take these tensors: use the torch twin then."""
    fn = c_paged_attention()
    if fn is None or not supports(q, k_cache, v_cache) or out.dtype != q.dtype or out.stride(-1) != 1:
        return False
    if sinks is not None and not (sinks.dtype == torch.float32 and sinks.is_contiguous()
                                  and sinks.shape == (q.shape[1],)):
        return False
    return run(fn, q, k_cache, v_cache, meta, scale, out, sliding_window, logit_softcap, sinks)


def run(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float, out: torch.Tensor, sliding_window: int | None, logit_softcap: float | None,
        sinks: torch.Tensor | None = None) -> bool:
    """paged_attention_cpu without its checks: fn = c_paged_attention(), tensors that `supports` took
    (an attention backend checks once, at load). False: a shape the C code declines."""
    tables, qsl, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
    if tables.dtype != torch.int32 or not tables.is_contiguous():
        tables = tables.to(torch.int32).contiguous()
    if qsl.dtype != torch.int32 or not qsl.is_contiguous():      # checked here: a no-op .to() is
        qsl = qsl.to(torch.int32).contiguous()                   # still a dispatch per layer
    if lens.dtype != torch.int32 or not lens.is_contiguous():
        lens = lens.to(torch.int32).contiguous()
    _, hq, D = q.shape
    _, bs, hkv, _ = k_cache.shape
    rc = fn(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
            tables.data_ptr(), tables.stride(0), qsl.data_ptr(), lens.data_ptr(),
            meta.num_seqs, hq, hkv, D, bs, float(scale), int(sliding_window or 0), float(logit_softcap or 0.0),
            None if sinks is None else sinks.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads())
    if rc == 2:
        raise ValueError("paged attention: a sequence has more new tokens than its length")
    if rc == 3:
        raise MemoryError("paged attention: scratch allocation failed")
    return rc == 0
