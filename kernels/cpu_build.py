"""Compiles the CPU C kernels (kernels/*.c) at first use into a per-user cache and loads them.

One .so per source, compiler flags and CPU (-march=native), written atomically, so concurrent
processes and a cache shared between machines are safe. No compiler, or CHATSERVE_CPU_KERNELS=0:
load() returns None and callers keep their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from chatserve_kernels import env

log = logging.getLogger(__name__)

ENV = env.CPU_KERNELS
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


def cache_dir() -> Path:
    return env.cache_root() / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags (a cached .so never moves machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def build(source: Path, compiler: str | None = None) -> Path:
    """Compile `source` into the cache (once per source, flags and CPU); return the .so path."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes()
    key = hashlib.sha256(src + " ".join(CFLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{platform.machine()}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".so")   # same filesystem as `out`
    os.close(fd)
    try:
        res = subprocess.run([cc, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                             timeout=120)
        if res.returncode:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp, out)             # atomic: concurrent builders each write their own temp file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library, or None (switched off, not Linux, or it could not be built)."""
    if not env.cpu_kernels_enabled() or platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(str(build(source)))
    except Exception as e:  # noqa: BLE001 — no compiler, read-only cache...: the torch path still works
        log.warning("CPU kernel %s unavailable (%s); using the torch path", source.name, e)
        return None
