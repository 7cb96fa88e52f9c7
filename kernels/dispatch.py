"""Backend choice shared by every kernel file: Triton on CUDA tensors, the torch twin elsewhere.

CHATSERVE_FORCE_TRITON=1 runs the Triton kernels on CPU tensors too, through triton's interpreter; the
tests use it. Not a kernel itself; triton stays optional.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from chatserve_kernels import env

# Triton decides at import time whether it interprets. Without CUDA, compiled Triton cannot run at all,
# so interpreting is the only useful mode: choose it here, before anything imports triton, whatever the
# order in which modules (or test files) import us. An explicit TRITON_INTERPRET wins.
if "triton" not in sys.modules and not torch.cuda.is_available():
    env.set_triton_interpret("1", only_if_unset=True)

try:  # triton is an optional dependency (the CPU install does not need it)
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None  # without triton the names exist as None (HAS_TRITON guards them)
    tl = None
    HAS_TRITON = False

FORCE_ENV = env.FORCE_TRITON


def jit(fn: Any = None, *, do_not_specialize: tuple[str, ...] = ()) -> Any:
    """`triton.jit` when triton is installed; otherwise the plain function (never launched).

    do_not_specialize: integer arguments that change from step to step (split sizes, the block table's
    width). Triton otherwise compiles a new variant whenever such a value turns 1 or a multiple of 16,
    and a server would compile in the middle of a user's request (measured on an H200: 6 kernels
    compiled during the first requests after the warm-up, TTFT p90 3.0 s against 0.17 s warm)."""
    if fn is None:
        return functools.partial(jit, do_not_specialize=do_not_specialize)
    if not HAS_TRITON:
        return fn
    return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if do_not_specialize else triton.jit(fn)


def merge_pad(splits: int) -> int:
    """The split-merge kernels' S_PAD for `splits` partials, in three widths (4, 16, 64) so a server
    compiles three merge variants at its warm-up rather than one per power of two as contexts grow."""
    for pad in (4, 16, 64):
        if splits <= pad:
            return pad
    return next_pow2(splits)


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    if not HAS_TRITON:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return env.triton_interpret() == "1"  # pragma: no cover - older triton


def use_triton(t: torch.Tensor) -> bool:
    """Pick the Triton path for this tensor: CUDA, or any tensor when forced (CPU via the interpreter)."""
    if not HAS_TRITON:
        return False
    if t.is_cuda:
        return True
    if env.force_triton():
        if not interpreting():
            raise RuntimeError(f"{FORCE_ENV}=1 on CPU tensors needs triton's interpreter: set "
                               "TRITON_INTERPRET=1 before triton is first imported")
        return True
    return False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def compute_dtype(dtype: torch.dtype, device: torch.device):
    """The tl dtype the attention dots run in, for a query of `dtype`.

    fp16/bf16 dots accumulate in fp32 on the GPU. The CPU interpreter's bf16 dot is wrong (numpy has
    no bf16), so there bf16 operands are widened to fp32, which gives the same products exactly.
    """
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and device.type == "cuda":
        return tl.bfloat16
    return tl.float32


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 4 on CPU so the interpreter splits too."""
    if device.type != "cuda":
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(compute) -> str:
    """fp32 dots stay exact ("ieee"); TF32 would cost ~1e-3 relative error. Others ignore the setting."""
    return "ieee" if compute == tl.float32 else "tf32"
