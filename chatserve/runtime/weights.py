"""Model weights: a GGUF file (read and dequantized with the `gguf` package) or a safetensors
directory (single or sharded, HF names + config.json) → an `ArchConfig` and HF-named torch tensors.

Not a model: fusing and placing the tensors is the model's job (models/llama.py); not config
parsing (arch_config.py, whose ArchConfig and UnsupportedModelError are re-exported here).
"""
from __future__ import annotations

import json
import mmap
import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from chatserve.runtime.models.linear_backends import BlockMatrix
from chatserve_kernels.block_formats import FORMATS, BlockWeight, RowOrderedWeight
from chatserve_kernels.tiled_store import TiledStore

# ArchConfig and UnsupportedModelError are also imported from here (models/, model_runner.py)
from chatserve.runtime.arch_config import (GGUF_ARCHS, ArchConfig, UnsupportedModelError, config_from_hf,
                                           gguf_config)
from chatserve.runtime.gguf_view import GGUF_MAGIC, is_gguf_file  # noqa: F401  (torch-free: model_source uses them)
from chatserve.runtime.mxfp4 import SUFFIXES as MXFP4_SUFFIXES
from chatserve.runtime.mxfp4 import fold_mxfp4

if TYPE_CHECKING:
    from chatserve.runtime.gguf_view import ViewReader

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}



def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}: use float32, bfloat16 or float16") from None


@dataclass
class LoadedWeights:
    config: ArchConfig
    tensors: dict[str, torch.Tensor | BlockMatrix]   # HF names: model.layers.0.self_attn.q_proj.weight, ...
    source: str                        # "gguf" | "safetensors"
    four_bit: bool = False             # GGUF whose matrices are mostly 4-bit (Q4_0/Q4_1/Q4_K): int4
                                       # weight-only decode reproduces them at no added error
    tiled_store: TiledStore | None = None  # in place: the file's tiled copies on disk (finish() once built)
    mapped_file: mmap.mmap | None = None   # in place: the GGUF's map, whose pages release_pages() drops

    def release_pages(self) -> None:
        """Once the model is built (its tiled copies made or mapped): drop this process's resident pages of the
        GGUF's map (madvise MADV_DONTNEED on a read-only file map: the page cache keeps them, RSS stops
        counting them). What is still read through the map (embedding rows, bands not tiled) faults back in
        from the page cache; the tiled bands' pages, read by neither kind of row any more, stay out."""
        if self.mapped_file is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapped_file.madvise(mmap.MADV_DONTNEED)


def load_weights(path: str | os.PathLike[str], dtype: str | torch.dtype = "float32",
                 progress: bool = True, in_place: bool = False) -> LoadedWeights:
    """Load a GGUF file or a safetensors directory (or a .safetensors file next to config.json).
    in_place: GGUF matrices stay in their block format as views of the mapped file (BlockMatrix)."""
    p = Path(path)
    dt = torch_dtype(dtype)
    if p.is_file() and (p.suffix == ".gguf" or is_gguf_file(p)):     # Ollama's blobs have no suffix
        return load_gguf(p, dt, progress, in_place)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not any(p.glob("*.safetensors")) and len(ggufs) == 1:
            return load_gguf(ggufs[0], dt, progress, in_place)
        return load_safetensors_dir(p, dt, progress)
    if p.is_file() and p.suffix == ".safetensors":
        return load_safetensors_dir(p.parent, dt, progress, files=[p])
    raise FileNotFoundError(f"no GGUF file or safetensors directory at {path}")


# ---------------------------------------------------------------------------------------------
# GGUF

def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF rotate-half layout ← GGML interleaved pairs).

    Per head the converter reorders rows [0..d/2) and [d/2..d) into pairs (0, d/2), (1, d/2+1), ...;
    here rows of each head are read as [d/2, 2] and transposed back to [2, d/2].
    """
    # w: [n_heads * head_dim, ...]
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in
       (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    **{f"ffn_{n}.{kind}": f"mlp.{n}_proj.{kind}" for n in ("gate", "up", "down") for kind in ("weight", "bias")},
    # MoE: the router, experts stacked on a first axis [E, ...] (models/moe.read_experts), the shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{n}_exps.weight": f"mlp.experts.{n}_proj.weight" for n in ("gate", "up", "down")},
    **{f"ffn_{n}_shexp.weight": f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")},
}
# names that differ per architecture (Gemma's four norms; Phi-3's fused gate_up stored as ffn_up)
_GGUF_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gpt-oss": {"ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                "attn_sinks.weight": "self_attn.sinks", "post_attention_norm.weight": "post_attention_layernorm.weight",
                **{f"ffn_{n}_exps.bias": f"mlp.experts.{n}_proj.bias" for n in ("gate", "up", "down")}},
    "mixtral": {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
                **{f"ffn_{n}_exps.weight": f"block_sparse_moe.experts.{w}.weight"
                   for n, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}},
}
_GGUF_ARCH_LAYER_NAMES["gemma3"] = _GGUF_ARCH_LAYER_NAMES["gemma2"]
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor (llama.cpp's names), None for one we do not know."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        hf = _GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(rest) or _GGUF_LAYER_NAMES.get(rest)
        if hf:
            return f"model.layers.{idx}.{hf}"
    return None


def gguf_reader(path: str | os.PathLike[str]) -> "ViewReader":
    """The GGUF reader of `path` (gguf_view.ViewReader: the header parsed over a plain ndarray view)."""
    from chatserve.runtime.gguf_view import ViewReader
    return ViewReader(str(path))


def block_matrix(t: Any, n_heads: int | None = None) -> BlockMatrix:
    """A 2-D GGUF tensor as raw blocks over the reader's memory map (no copy). Q/K (n_heads given): its rows
    read back in HF order through a RowOrderedWeight, copied only if a kernel reads the file's blocks (a band
    tiled from the cache file never does)."""
    n, k = (int(x) for x in reversed(t.shape))
    raw = np.asarray(t.data).view(np.uint8).reshape(n, -1)
    if not n_heads:
        return _blocks(raw, t.tensor_type.name, n, k)
    order = torch.from_numpy(np.ascontiguousarray(unpermute_qk(np.arange(n), n_heads)))
    return BlockMatrix([RowOrderedWeight(_readonly_tensor(raw), order, FORMATS[t.tensor_type.name], n, k)])


def _readonly_tensor(raw: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only array of the reader's map (the kernels only read it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


def _blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> BlockMatrix:
    """raw uint8 [n, row bytes] (a view of the reader's map) as a one-band BlockMatrix, without a copy."""
    return BlockMatrix([BlockWeight(_readonly_tensor(raw), FORMATS[fmt], n, k)])


def _file_map(data: np.ndarray) -> mmap.mmap | None:
    """The mmap under a reader's array (an ndarray view of a np.memmap), or None."""
    a: Any = data
    while a is not None and not isinstance(getattr(a, "_mmap", None), mmap.mmap):
        a = getattr(a, "base", None)
    return None if a is None else a._mmap


# MoE families whose experts models/moe.read_experts also reads one tensor each (p.experts.{e}.…): a stacked
# GGUF expert tensor kept in place is handed to them as per-expert views
_PER_EXPERT_ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "mixtral")


def expert_block_matrices(t: Any, hf: str) -> dict[str, BlockMatrix]:
    """A stacked GGUF expert tensor [E, n, k] in a block format as E BlockMatrix views of the map (no
    copy), named as a checkpoint with one tensor per expert names them (…experts.{e}.…)."""
    e_count, n, k = (int(x) for x in reversed(t.shape))
    raw = np.asarray(t.data).view(np.uint8).reshape(e_count, n, -1)          # [E, n, row bytes]
    head, tail = hf.split(".experts.", 1)
    return {f"{head}.experts.{e}.{tail}": _blocks(raw[e], t.tensor_type.name, n, k) for e in range(e_count)}


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
              progress: bool = True, in_place: bool = False) -> LoadedWeights:
    """Read a GGUF file, dequantize every tensor (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K/...); with
    in_place, the matrices of a format in block_formats.FORMATS stay as BlockMatrix views instead."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    # bands over the file's map are keyed by their offset: a warm load reads none of its pages
    store = TiledStore.for_file(path, (int(reader.data.ctypes.data), int(reader.data.nbytes))) if in_place else None
    # numpy shapes (row-major, i.e. GGUF ne reversed) after dequantization
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    cfg = gguf_config(reader, shapes)
    permuted = GGUF_ARCHS[cfg.arch]
    tensors: dict[str, torch.Tensor | BlockMatrix] = {}
    freq_factors = None
    long_short: dict[str, list[float]] = {}
    gemma = cfg.arch in ("gemma2", "gemma3")
    n4 = sum(1 for t in reader.tensors if t.tensor_type.name in ("Q4_0", "Q4_1", "Q4_K"))
    n_matrices = sum(1 for t in reader.tensors if len(t.shape) == 2)
    bar = tqdm(reader.tensors, desc=f"loading {Path(path).name}", unit="tensor",
               disable=not progress, file=sys.stderr, leave=False)
    for t in bar:
        hf = gguf_to_hf_name(t.name, cfg.arch)
        if in_place and hf and len(t.shape) == 3 and cfg.arch in _PER_EXPERT_ARCHS \
                and t.tensor_type.name in FORMATS and ".experts." in hf:
            for name, bm in expert_block_matrices(t, hf).items():
                bm.store = store        # where their tiled decode copies live, if the model tiles experts
                tensors[name] = bm
            continue
        if in_place and hf and len(t.shape) == 2 and t.tensor_type.name in FORMATS:
            qk = permuted and (".attn_q." in t.name or ".attn_k." in t.name)
            bm = block_matrix(t, (cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads) if qk else None)
            bm.store = store
            tensors[hf] = bm
            continue
        arr = dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(shapes[t.name])
        if not arr.flags.writeable:          # F32 tensors come back as views of the read-only map
            arr = arr.copy()
        if t.name == "rope_freqs.weight":
            freq_factors = tuple(float(x) for x in arr.reshape(-1))
            continue
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            long_short[t.name.split("_")[2].split(".")[0]] = [float(x) for x in arr.reshape(-1)]
            continue
        hf = gguf_to_hf_name(t.name, cfg.arch) or t.name     # unknown names fail the exact load later
        if gemma and t.name.endswith("norm.weight"):
            arr = arr - 1.0               # llama.cpp stores Gemma's (1 + w); the model adds the 1 back
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            n = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            arr = unpermute_qk(arr, n)
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    bar.close()
    if freq_factors is not None:
        cfg = replace(cfg, rope_freq_factors=freq_factors)
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "longrope":
        if set(long_short) != {"long", "short"}:
            raise UnsupportedModelError("GGUF LongRoPE needs rope_factors_long and rope_factors_short")
        cfg = replace(cfg, rope_scaling={**cfg.rope_scaling, "long_factor": long_short["long"],
                                         "short_factor": long_short["short"]})
    return LoadedWeights(cfg, tensors, "gguf", four_bit=n4 * 2 > n_matrices, tiled_store=store,
                         mapped_file=_file_map(reader.data) if in_place else None)


# ---------------------------------------------------------------------------------------------
# safetensors + config.json

def load_safetensors_dir(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                         progress: bool = True, files: list[Path] | None = None) -> LoadedWeights:
    from safetensors import safe_open

    d = Path(path)
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{d} has no config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    if files is None:
        index = d / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [d / n for n in names]
        else:
            files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d} has no *.safetensors files")
    tensors: dict[str, torch.Tensor | BlockMatrix] = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]  # type: ignore[no-untyped-call]  # safetensors' stub
    mxfp4: dict[str, torch.Tensor] = {}          # gpt-oss's FP4 experts, kept as stored until folded
    for h, k in tqdm(keys, desc=f"loading {d.name}", unit="tensor", disable=not progress,
                     file=sys.stderr, leave=False):
        name = k if k.startswith(("model.", "lm_head.")) else f"model.{k}"
        if name.endswith(MXFP4_SUFFIXES):
            mxfp4[name] = h.get_tensor(k)
        else:
            tensors[name] = h.get_tensor(k).to(dtype)
    tensors.update(fold_mxfp4(mxfp4, dtype))
    if "lm_head.weight" not in tensors and not cfg.tie_word_embeddings:
        cfg = replace(cfg, tie_word_embeddings=True)
    return LoadedWeights(cfg, tensors, "safetensors")
