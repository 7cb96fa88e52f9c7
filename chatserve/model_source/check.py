"""Model files checked before they are loaded: a GGUF file (gguf_check.py) or a safetensors folder (config,
every shard the index names, each shard's header), then the memory it needs against what is available.

Runs before anything large is mapped; every failure is one line (ModelCheckError, or the config's
UnsupportedModelError). Not the loader: weights.py still reads exactly what it is given.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from chatserve.config import CacheConfig
from chatserve.model_source.errors import ModelCheckError
from chatserve.model_source.gguf_check import gguf_arch_config, is_gguf_file
from chatserve.model_source.hub import SPLIT_RE, one_line
from chatserve.runtime.arch_config import ArchConfig, config_from_hf

RUNTIME_BYTES = 512 << 20      # torch, the tokenizer, activations: the least a server takes beyond them
KV_ELEMENT_BYTES = {"float32": 4, "int8": 1, "fp8": 1, "fp8_per_tensor": 1}   # else 2 (fp16/bf16)


@dataclass(frozen=True)
class CheckedModel:
    config: ArchConfig
    files: tuple[Path, ...]     # the files whose bytes are the weights
    weight_bytes: int           # their size as stored (what in-place loading keeps resident)


def check_files(path: str | Path) -> CheckedModel:
    """Read the headers of the model at `path` (a GGUF file, a safetensors folder or one .safetensors)."""
    p = Path(path)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not any(p.glob("*.safetensors")) and len(ggufs) == 1:
            p = ggufs[0]
        else:
            return check_safetensors_dir(p)
    if p.suffix == ".safetensors":
        return check_safetensors_dir(p.parent, [p])
    if not p.is_file():
        raise FileNotFoundError(f"no GGUF file or safetensors directory at {path}")
    if p.suffix != ".gguf" and not is_gguf_file(p):
        raise ModelCheckError(f"{p} is neither a GGUF file nor a safetensors folder")
    return CheckedModel(gguf_arch_config(p), (p,), p.stat().st_size)


def shard_files(d: Path) -> list[Path]:
    """The safetensors files of a folder: those its index names, else all; a missing shard is an error."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelCheckError(f"{index} is not a safetensors index ({one_line(e)})") from None
    else:
        names = sorted(f.name for f in d.glob("*.safetensors"))
        totals = {int(m.group(2)) for n in names if (m := SPLIT_RE.search(n))}
        if len(totals) == 1:     # model-00001-of-00003.safetensors …: every part must be there
            total = totals.pop()
            stem = SPLIT_RE.sub("-{:05d}-of-" + f"{total:05d}", next(n for n in names if SPLIT_RE.search(n)))
            names = [stem.format(i) for i in range(1, total + 1)]
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise ModelCheckError(f"{d} lacks the safetensors shard{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(missing)} of {len(names)}")
    if not names:
        raise ModelCheckError(f"{d} has no *.safetensors files")
    return [d / n for n in names]


def check_safetensors_dir(d: Path, files: list[Path] | None = None) -> CheckedModel:
    from safetensors import safe_open

    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ModelCheckError(f"{d} has no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ModelCheckError(f"{cfg_file} is not JSON ({one_line(e)})") from None
    config = config_from_hf(hf)
    files = files or shard_files(d)
    for f in files:
        try:
            with safe_open(str(f), framework="numpy"):
                pass
        except Exception as e:     # safetensors' own error: a header too short, bad JSON, data past the end
            raise ModelCheckError(f"{f} is not a readable safetensors file ({one_line(e)})") from None
    return CheckedModel(config, tuple(files), sum(f.stat().st_size for f in files))


def kv_cache_bytes(config: ArchConfig, cache: CacheConfig, dtype: str) -> int:
    """The KV cache the runner will allocate: the budget, or an exact block count's bytes."""
    if cache.num_blocks is None:
        return int(cache.kv_cache_memory)
    kind = dtype if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * KV_ELEMENT_BYTES.get(kind, 2)
    return int(cache.num_blocks) * int(cache.block_size) * per_token


def available_memory() -> int | None:
    """Bytes this process may still take: MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def human_size(n: int) -> str:
    """Bytes for people: 94.2 MiB, 4.9 GiB, 64.0 TiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_memory(name: str, weight_bytes: int, kv_bytes: int, available: int | None) -> None:
    """ModelCheckError when weights + KV cache + runtime exceed the memory available (a lower bound of
    the need: the weights as stored, in place)."""
    need = weight_bytes + kv_bytes + RUNTIME_BYTES
    if available is not None and need > available:
        raise ModelCheckError(
            f"{name} needs about {human_size(need)} of memory (weights {human_size(weight_bytes)} + KV cache "
            f"{human_size(kv_bytes)} + runtime {human_size(RUNTIME_BYTES)}) but {human_size(available)} is "
            f"available: lower --kv-cache-memory "
            f"or serve a smaller model or quant")


def check_model(path: str | Path, cache: CacheConfig, dtype: str, *, on_cpu: Callable[[], bool],
                name: str | None = None) -> CheckedModel:
    """The files checked, then (on CPU, where weights and KV cache share the machine's memory) the fit.
    on_cpu is asked only once the files pass: finding out may import torch (seconds), which a bad file's
    one-line error does not need."""
    try:
        checked = check_files(path)
    except FileNotFoundError:
        raise
    except OSError as e:             # unreadable: permissions, an I/O error
        raise ModelCheckError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
    if on_cpu():
        check_memory(name or os.path.basename(str(path).rstrip("/")), checked.weight_bytes,
                     kv_cache_bytes(checked.config, cache, dtype), available_memory())
    return checked
