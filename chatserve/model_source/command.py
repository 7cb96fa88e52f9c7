"""`chatserve models`: what can be served without a download (the Hugging Face cache, Ollama's store, the
default model), with sizes; `chatserve models pull NAME` finds or fetches NAME and prints its path.

Not the resolution itself (resolve.py, hub.py, ollama.py); this only prints it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from chatserve.config import DEFAULT_MODEL_FILE, default_model_path
from chatserve.model_source import hub, ollama
from chatserve.model_source.check import human_size
from chatserve.model_source.errors import ModelSourceError
from chatserve.model_source.resolve import resolve_model


@dataclass(frozen=True)
class LocalModel:
    name: str          # what `chatserve serve NAME` takes
    size: int          # bytes of its weights
    source: str        # huggingface | ollama | default
    path: Path


def hub_models() -> list[LocalModel]:
    """Each cached GGUF file as `repo:TAG`, each complete safetensors snapshot as `repo`."""
    from huggingface_hub import CacheNotFound, scan_cache_dir
    try:
        repos = scan_cache_dir().repos
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        rev = repo.refs.get("main") if repo.repo_type == "model" else None
        if rev is None:
            continue
        files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
        for name, f in sorted(files.items()):
            if name.lower().endswith(".gguf") and "mmproj" not in name.lower() and not hub.SPLIT_RE.search(name):
                found.append(LocalModel(f"{repo.repo_id}:{hub.quant_tag(name)}", f.size_on_disk,
                                        "huggingface", f.file_path))
        if hub.complete_safetensors(rev.snapshot_path, list(files)):
            size = sum(f.size_on_disk for n, f in files.items() if n.endswith(".safetensors"))
            found.append(LocalModel(repo.repo_id, size, "huggingface", rev.snapshot_path))
    return found


def local_models() -> list[LocalModel]:
    found = hub_models()
    found += [LocalModel(m.name, m.size, "ollama", m.blob) for m in ollama.local_models()]
    default = default_model_path()
    if default:
        found.append(LocalModel(DEFAULT_MODEL_FILE.removesuffix(".gguf") + " (default)",
                                Path(default).stat().st_size, "default", Path(default)))
    return found


def table(models: list[LocalModel]) -> str:
    rows = [("NAME", "SIZE", "SOURCE", "PATH")] + [(m.name, human_size(m.size), m.source, str(m.path))
                                                   for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chatserve models", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action")
    sub.add_parser("list", help="the models on this machine, with sizes (the default action)")
    pull = sub.add_parser("pull", help="find NAME locally or fetch it from the Hub; print its path")
    pull.add_argument("name", help="org/repo, org/repo:QUANT, an Ollama name (qwen3:4b) or a path")
    args = p.parse_args(argv)
    if args.action == "pull":
        try:
            print(resolve_model(args.name).path)
        except (ModelSourceError, FileNotFoundError) as e:
            print(f"chatserve models: {e}", file=sys.stderr)
            return 1
        return 0
    models = local_models()
    print(table(models) if models else "no local models (serve one by name to fetch it)")
    return 0
