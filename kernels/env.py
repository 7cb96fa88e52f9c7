"""The environment variables the kernels read, read here and nowhere else in kernels/.

kernels/ imports nothing of chatserve, so these cannot come from chatserve/config.py; config.py declares
the same names and meanings (`PROCESS_ENV` for the CHATSERVE_* switches, `FOREIGN_ENV` for CC,
TRITON_INTERPRET and XDG_CACHE_HOME), and tests/test_config.py checks that the lists agree. They are
process-wide switches read at first use, not per-engine settings. No torch here.
"""
from __future__ import annotations

import os
from pathlib import Path

CPU_KERNELS = "CHATSERVE_CPU_KERNELS"    # "0": never build or load the C kernels (the torch path runs)
FORCE_TRITON = "CHATSERVE_FORCE_TRITON"  # "1": Triton kernels on CPU tensors too (needs TRITON_INTERPRET=1)
CACHE_DIR = "CHATSERVE_CACHE_DIR"        # the per-user cache root (compiled kernels live in <root>/kernels)
MOE_KERNEL = "CHATSERVE_MOE_KERNEL"      # "0": MoE decode rows through the expert loop, not cpu_moe's one call
MOE_TILED = "CHATSERVE_MOE_TILED"        # in-place MoE experts' tiled decode copies: "1" always, "0" never, else
                                         # when they fit (moe_tiled())
WEIGHT_CACHE = "CHATSERVE_WEIGHT_CACHE"  # "0": never read or write cpu_qmatmul's packed weights on disk
WEIGHT_CACHE_DIR = "CHATSERVE_WEIGHT_CACHE_DIR"   # where they live (default <cache root>/qmatmul)
AMX = "CHATSERVE_AMX"                    # "0": cpu_blockmm's AVX-512 level never uses the AMX tiles (bf16 x too on
                                         # its fp32 dot products; for A/B runs)
NAMES = (CPU_KERNELS, FORCE_TRITON, CACHE_DIR, MOE_KERNEL, MOE_TILED, WEIGHT_CACHE, WEIGHT_CACHE_DIR, AMX)
# other programs' variables the kernels honour (config.FOREIGN_ENV declares them too)
CC = "CC"                                # the C compiler for the CPU kernels
TRITON_INTERPRET = "TRITON_INTERPRET"    # triton's own switch: "1" runs kernels in its CPU interpreter
XDG_CACHE_HOME = "XDG_CACHE_HOME"        # the cache root's parent when CACHE_DIR is unset
FOREIGN = (CC, TRITON_INTERPRET, XDG_CACHE_HOME)


def cpu_kernels_enabled() -> bool:
    return os.environ.get(CPU_KERNELS, "1") != "0"


def moe_kernel_enabled() -> bool:
    """cpu_moe's one call per MoE layer for decode rows (read when a model is built; "0" for A/B runs)."""
    return os.environ.get(MOE_KERNEL, "1") != "0"


def moe_tiled() -> bool | None:
    """GGUF-in-place MoE experts with a row-interleaved copy for decode rows: True ("1"), False ("0"), None
    (unset or anything else: the model decides by the copy's size against the machine's memory)."""
    v = os.environ.get(MOE_TILED, "")
    return True if v == "1" else False if v == "0" else None


def weight_cache_enabled() -> bool:
    """cpu_qmatmul's packed weights kept on disk between processes (cpu_qmatmul.pack_cached)."""
    return os.environ.get(WEIGHT_CACHE, "1") != "0"


def weight_cache_dir() -> Path:
    """$CHATSERVE_WEIGHT_CACHE_DIR, else <cache root>/qmatmul (the test suite points it at a directory of its
    own, removed when the run ends, so its random-weight models leave nothing in the user's cache)."""
    return Path(os.environ.get(WEIGHT_CACHE_DIR) or cache_root() / "qmatmul")


def cpu_amx_enabled() -> bool:
    """cpu_blockmm's AMX-BF16 path for bf16 rows where the CPU has it (read when the kernel loads)."""
    return os.environ.get(AMX, "1") != "0"


def force_triton() -> bool:
    return os.environ.get(FORCE_TRITON, "0") == "1"


def cache_root() -> Path:
    """$CHATSERVE_CACHE_DIR, else $XDG_CACHE_HOME/chatserve or ~/.cache/chatserve (as chatserve.config's)."""
    return Path(os.environ.get(CACHE_DIR) or os.path.join(
        os.environ.get(XDG_CACHE_HOME) or os.path.expanduser("~/.cache"), "chatserve"))


def cc() -> str | None:
    """$CC, or None when unset or empty."""
    return os.environ.get(CC) or None


def triton_interpret() -> str:
    """$TRITON_INTERPRET as set ("0" when unset)."""
    return os.environ.get(TRITON_INTERPRET, "0")


def set_triton_interpret(value: str, *, only_if_unset: bool = False) -> None:
    """Set TRITON_INTERPRET for triton to read at its import (an explicit setting wins with only_if_unset)."""
    if only_if_unset:
        os.environ.setdefault(TRITON_INTERPRET, value)
    else:
        os.environ[TRITON_INTERPRET] = value
