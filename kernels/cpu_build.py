"""Compiles the CPU C kernels (kernels/*.c) at first use into a per-user cache and loads them.

One .so per source, compiler flags and CPU (-march=native), written atomically, so concurrent
processes and a cache shared between machines are safe. `KERNELS` registers each source with the CPU
flags its fast path needs. load() returns None (callers keep their torch path) and records why in
`status()`: switched off, no compiler, the CPU lacks the instructions (prerequisites missing), or the
.c file failed to compile, a real error whose compiler stderr is logged and kept for the tests.
It is not the kernels' ctypes bindings (each kernels/cpu_*.py owns its own).
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
from dataclasses import dataclass
from pathlib import Path

from chatserve_kernels import env

log = logging.getLogger(__name__)

ENV = env.CPU_KERNELS
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]

# Kernel (source stem) → the /proc/cpuinfo flags its fast path needs. A source not listed needs none:
# it must compile and load wherever a compiler is. Add new kernels here.
KERNELS: dict[str, tuple[str, ...]] = {
    "cpu_qmatmul": ("avx2", "fma", "f16c"),      # its AVX2 level; AVX-512 VNNI where -march=native has it
    "cpu_attention": (),
    "cpu_ops": (),
}

# Outcomes of load(), in status().state
LOADED, DISABLED, NO_COMPILER, CPU_LACKS, BUILD_FAILED, LOAD_FAILED = (
    "loaded", "disabled", "no compiler", "cpu lacks instructions", "build failed", "load failed")


class BuildError(RuntimeError):
    """The compiler ran and rejected the source: `stderr` says why."""

    def __init__(self, source: Path, cc: str, stderr: str):
        super().__init__(f"{cc} failed on {source.name}:\n{stderr}")
        self.stderr = stderr


@dataclass(frozen=True)
class KernelStatus:
    """Why a kernel did or did not load; `prerequisites_met` is False only when the machine, not the
    code, is missing something (no compiler, not Linux, CPU flags, switched off)."""
    name: str
    state: str
    detail: str = ""

    @property
    def loaded(self) -> bool:
        return self.state == LOADED

    @property
    def prerequisites_met(self) -> bool:
        return self.state in (LOADED, BUILD_FAILED, LOAD_FAILED)

    def __str__(self) -> str:
        return f"{self.name}: {self.state}" + (f" ({self.detail})" if self.detail else "")


_status: dict[str, KernelStatus] = {}


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


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    for line in _cpu_id().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compiler() -> str | None:
    """$CC when it names a program that exists, else cc or gcc on PATH; None when there is none."""
    if cc := env.cc():
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def missing_flags(name: str) -> list[str]:
    """The CPU flags kernel `name` needs that this CPU lacks."""
    have = cpu_flags()
    return [f for f in KERNELS.get(name, ()) if f not in have]


def composed_source(stem: str, text: str) -> Path:
    """A source put together from several files (a prelude, shared helpers, another kernel's source) written
    once into the cache as `{stem}_{hash of text}.c`, so that an edit to any part rebuilds it."""
    src = text.encode()
    path = cache_dir() / f"{stem}_{hashlib.sha256(src).hexdigest()[:12]}.c"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".c")
        with os.fdopen(fd, "wb") as f:
            f.write(src)
        os.replace(tmp, path)            # atomic: concurrent writers write the same bytes
    return path


def build(source: Path, compiler_path: str | None = None) -> Path:
    """Compile `source` into the cache (once per source, flags and CPU); return the .so path.
    Raises FileNotFoundError without a compiler, BuildError when the compiler rejects the source."""
    cc = compiler_path or compiler()
    if not cc:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
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
            raise BuildError(source, cc, res.stderr.strip()[-4000:])
        os.replace(tmp, out)             # atomic: concurrent builders each write their own temp file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _prerequisite_gap(name: str) -> KernelStatus | None:
    """Why this machine cannot have kernel `name` at all, or None when it can."""
    if not env.cpu_kernels_enabled():
        return KernelStatus(name, DISABLED, f"{ENV}=0")
    if platform.system() != "Linux":
        return KernelStatus(name, CPU_LACKS, f"not Linux ({platform.system()})")
    if compiler() is None:
        return KernelStatus(name, NO_COMPILER, f"CC={env.cc()!r} not found" if env.cc()
                            else "no cc/gcc on PATH")
    if gap := missing_flags(name):
        return KernelStatus(name, CPU_LACKS, "needs " + " ".join(gap))
    return None


def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library, or None (switched off, prerequisites missing, or it failed to build: then
    the error is logged and kept in status(); the torch path still works)."""
    name = source.stem
    gap = _prerequisite_gap(name)
    if gap is not None:
        _status[name] = gap
        log.log(logging.INFO if gap.state == DISABLED else logging.WARNING,
                "CPU kernel %s unavailable (%s); using the torch path", source.name, gap.detail)
        return None
    try:
        lib = ctypes.CDLL(str(build(source)))
    except BuildError as e:
        _status[name] = KernelStatus(name, BUILD_FAILED, e.stderr)
        log.error("CPU kernel %s unavailable: it does not compile; using the torch path:\n%s",
                  source.name, e.stderr)
        return None
    except (OSError, subprocess.SubprocessError) as e:   # read-only cache, a broken .so, a hung compiler
        _status[name] = KernelStatus(name, LOAD_FAILED, str(e))
        log.error("CPU kernel %s unavailable: it could not be loaded (%s); using the torch path", source.name, e)
        return None
    _status[name] = KernelStatus(name, LOADED)
    return lib


def status(name: str) -> KernelStatus | None:
    """What the last load() of kernel `name` (a source stem) found; None before any load()."""
    return _status.get(name)


def sources() -> list[Path]:
    """Every C kernel source in this folder."""
    return sorted(Path(__file__).parent.glob("*.c"))
