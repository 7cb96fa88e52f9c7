"""Hugging Face repos by name: `org/repo` (its safetensors) or `org/repo:QUANT` (one GGUF file of a GGUF
repo). A model already in huggingface_hub's cache is used from there without a request; otherwise the
hub client fetches it (its progress bar, HF_TOKEN, HF_ENDPOINT). HF_HUB_OFFLINE keeps it to the cache.

Not the Ollama store (ollama.py), and not the checks on the files (check.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from chatserve.model_source.errors import ModelSourceError

REPO_RE = re.compile(r"(?:hf\.co/|huggingface\.co/)?([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::([\w.-]+))?")
DEFAULT_QUANT = "Q4_K_M"        # what llama.cpp's `-hf org/repo` picks when no tag is given
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})(?=\.(?:gguf|safetensors)$)")
# a safetensors repo: the weights, their config, tokenizer and chat template; not .bin, .onnx or GGUF
SAFETENSORS_FILES = ["*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt",
                     "vocab.txt"]


@dataclass(frozen=True)
class RepoName:
    repo_id: str
    tag: str | None             # a GGUF quant tag (Q4_K_M), None for the repo's safetensors or only GGUF

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.tag}" if self.tag else self.repo_id


def parse_repo_name(text: str) -> RepoName | None:
    m = REPO_RE.fullmatch(text.strip())
    return RepoName(m.group(1), m.group(2)) if m else None


def quant_tag(filename: str) -> str:
    """The quant tag of a GGUF file name: `Qwen3-4B-Q4_K_M.gguf` → `Q4_K_M` (after the last - or .)."""
    stem = SPLIT_RE.sub("", filename.rsplit("/", 1)[-1])
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return re.split(r"[-.]", stem)[-1].upper()


def pick_gguf(name: RepoName, files: list[str]) -> str | None:
    """The one GGUF file `name` asks for among a repo's files; None for the repo's safetensors (no tag
    given and the repo has some, or no GGUF at all). Vision projectors (mmproj) are not models; split
    GGUFs are refused."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    if not name.tag and (not ggufs or any(f.endswith(".safetensors") for f in files)):
        return None
    if not ggufs:
        raise ModelSourceError(f"{name.repo_id} has no GGUF files (asked for the quant {name.tag})")
    tag = name.tag or (None if len(ggufs) == 1 else DEFAULT_QUANT)
    found = [f for f in ggufs if tag is None or quant_tag(f) == tag.upper()]
    if not found:
        tags = ", ".join(sorted({quant_tag(f) for f in ggufs}))
        asked = f"no {tag} file" if name.tag else f"no tag given and no {DEFAULT_QUANT} file"
        raise ModelSourceError(f"{name.repo_id} has {asked}; its GGUF quants: {tags} "
                               f"(serve {name.repo_id}:<QUANT>)")
    if any(SPLIT_RE.search(f) for f in found):
        raise ModelSourceError(f"{name} is a split GGUF ({found[0]} …): chatserve reads single-file GGUFs; "
                               f"merge the parts with llama.cpp's `llama-gguf-split --merge`")
    return found[0]


def cached_snapshot(repo_id: str) -> tuple[Path, list[str]] | None:
    """The cached snapshot `main` points to and its files (paths inside the repo), or None."""
    from huggingface_hub import CacheNotFound, scan_cache_dir
    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return None
    for repo in info.repos:
        if repo.repo_type == "model" and repo.repo_id == repo_id and "main" in repo.refs:
            rev = repo.refs["main"]
            return rev.snapshot_path, sorted(f.file_path.relative_to(rev.snapshot_path).as_posix()
                                             for f in rev.files)
    return None


def complete_safetensors(root: Path, files: list[str]) -> bool:
    """A config.json and the weights: every shard the index names (or every part of a -NNNNN-of-NNNNN
    set), or an unsharded file."""
    if "config.json" not in files:
        return False
    shards = [f for f in files if f.endswith(".safetensors")]
    if "model.safetensors.index.json" in files:
        try:
            wanted = set(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return wanted <= set(shards)
    totals = {int(m.group(2)) for f in shards if (m := SPLIT_RE.search(f))}
    if totals:
        return len(totals) == 1 and len(shards) == totals.pop()
    return bool(shards)


def from_cache(name: RepoName) -> Path | None:
    """The model's local path when the cache already holds what `name` asks for."""
    snap = cached_snapshot(name.repo_id)
    if snap is None:
        return None
    root, files = snap
    try:
        gguf = pick_gguf(name, files)
    except ModelSourceError:
        return None          # perhaps the file is on the Hub but not cached yet
    if gguf is not None:
        return root / gguf
    return root if not name.tag and complete_safetensors(root, files) else None


def resolve_repo(name: RepoName) -> Path:
    """The local path of `name`: from the cache, else downloaded (unless HF_HUB_OFFLINE)."""
    from huggingface_hub import constants
    cached = from_cache(name)
    if cached is not None:
        return cached
    if constants.HF_HUB_OFFLINE:
        raise ModelSourceError(f"{name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                               f"and HF_HUB_OFFLINE is set")
    try:
        return download(name)
    except ModelSourceError:
        raise
    except Exception as e:     # the hub client's errors: not found, gated, unauthorized, connection
        raise ModelSourceError(f"could not fetch {name} from {constants.ENDPOINT}: {one_line(e)}") from None


def download(name: RepoName) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    files = HfApi().list_repo_files(name.repo_id)
    gguf = pick_gguf(name, files)
    if gguf is not None:
        return Path(hf_hub_download(name.repo_id, gguf))
    if not any(f.endswith(".safetensors") for f in files):
        raise ModelSourceError(f"{name.repo_id} has neither GGUF nor safetensors weights")
    return Path(snapshot_download(name.repo_id, allow_patterns=SAFETENSORS_FILES))


def one_line(e: BaseException) -> str:
    """An exception's message on one line (the hub client's errors span several)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
