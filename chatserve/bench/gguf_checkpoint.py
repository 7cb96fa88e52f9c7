"""`chatserve bench build-gguf`: a random-weight GGUF of a real model's shape (Llama-3.2-1B, Llama-3.1-8B,
Qwen3-30B-A3B's layers) in one block format or llama.cpp's Q4_K_M mix, written from random blocks
(block_formats.random_weight: every code, finite scales) straight to the file, one tensor at a time, for
load-time, RSS, speed and quality figures of GGUF weights (issues 30 and 32), here and in llama.cpp. Not a
model anyone can talk to (no tokenizer: `tokenizer.ggml.model` is llama.cpp's "no_vocab").

Not a quantizer: no float weights exist; each block's codes and scales are drawn directly, its scales sized
so that every format's weights have the spread of the Q4_0 file's (so a Q8_0 or K-quant file is no louder).
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# llama.cpp's file types (llama_ftype), written as general.file_type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 14,
              "Q4_K_M": 15, "Q5_K": 16, "Q6_K": 18, "BF16": 32}
MIXES = ("Q4_K_M",)


@dataclass(frozen=True)
class GGUFShape:
    """The hyperparameters a GGUF of one model shape carries (llama.cpp's key names, arch prefix)."""
    arch: str                  # "llama" | "qwen3moe"
    layers: int
    hidden: int
    ffn: int                   # dense FFN width (MoE: the model card's, unused by the expert layers)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool                 # no output.weight: the embedding is the LM head
    rope_theta: float
    rms_eps: float
    context: int
    experts: int = 0           # MoE: experts per layer, each of width expert_ffn, top expert_used
    expert_used: int = 0
    expert_ffn: int = 0


SHAPES: dict[str, GGUFShape] = {
    # meta-llama/Llama-3.2-1B: 16 layers, tied embeddings, Llama 3's 128,256-token vocabulary
    "llama-3.2-1b": GGUFShape("llama", 16, 2048, 8192, 32, 8, 64, 128256, True, 500000.0, 1e-5, 131072),
    # meta-llama/Llama-3.1-8B: 32 layers, untied head
    "llama-3.1-8b": GGUFShape("llama", 32, 4096, 14336, 32, 8, 128, 128256, False, 500000.0, 1e-5, 131072),
    # Qwen/Qwen3-30B-A3B with 2 of its 48 layers (--layers for more): 128 experts of 768, top 8, GQA 32/4
    # of head_dim 128, q/k norms, its 151,936-token vocabulary and untied head
    "qwen3-30b-a3b-2l": GGUFShape("qwen3moe", 2, 2048, 6144, 32, 4, 128, 151936, False, 1000000.0, 1e-6,
                                  40960, experts=128, expert_used=8, expert_ffn=768),
}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits in its _M mixes: the first
    and last eighth of the layers, and every third layer between them."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_format(fmt: str, role: str, layer: int, shape: GGUFShape) -> str:
    """The block format of the matrix `role` (llama.cpp's tensor name without blk.N. and .weight) of
    `layer` (-1: not in a layer) in a file of `fmt`. Q4_K_M, as llama.cpp's quantizer chooses it: Q6_K for
    output (for token_embd when the head is tied to it), and for attn_v and ffn_down (ffn_down_exps
    included) of the layers where use_more_bits holds; Q4_K for every other matrix; and for a model of
    exactly 8 experts (Mixtral) attn_k and attn_v in Q8_0 and attn_output in Q5_K. Checked against
    llama-cpp-python 0.3.36's llama_model_quantize on F16 files of these shapes (16 layers; 8 and 16
    experts): the same type for every tensor."""
    if fmt != "Q4_K_M":
        return fmt
    if role == "output" or (role == "token_embd" and shape.tied):
        return "Q6_K"
    if shape.experts == 8 and role in ("attn_k", "attn_v", "attn_output"):
        return "Q5_K" if role == "attn_output" else "Q8_0"
    if role in ("attn_v", "ffn_down", "ffn_down_exps") and use_more_bits(layer, shape.layers):
        return "Q6_K"
    return "Q4_K"


@functools.cache
def _unit_spread(fmt: str) -> float:
    """The std of a random `fmt` weight drawn with scale 1 (codes × scales of that format)."""
    from chatserve_kernels.block_formats import dequantize, random_weight

    return float(dequantize(random_weight(fmt, 64, 1024, seed=1, scale=1.0)).float().std())


def block_scale(fmt: str, scale: float) -> float:
    """The scale to draw `fmt` blocks with so that their weights spread as Q4_0 blocks of `scale` do."""
    return scale * _unit_spread("Q4_0") / _unit_spread(fmt)


def default_path(fmt: str, shape: str = "llama-3.2-1b", layers: int | None = None) -> Path:
    from chatserve.disk_cache import cache_dir

    stem = shape
    if layers is not None and layers != SHAPES[shape].layers:
        stem = f"{stem.removesuffix('-2l')}-{layers}l"
    return cache_dir("checkpoints") / f"{stem}-random-{fmt}.gguf"


@dataclass(frozen=True)
class _Tensor:
    name: str
    fmt: str                   # a block format, or "F32" for the ones-filled norms and the router
    dims: tuple[int, ...]      # numpy order: (rows, cols) or (experts, rows, cols)
    scale: float = 0.0         # 0: a norm (ones); else the Q4_0-equivalent random scale
    role: str = ""


def tensor_plan(shape: GGUFShape, fmt: str) -> list[_Tensor]:
    """Every tensor of the file, in llama.cpp's names and order, with its format."""
    s = shape
    fmt_of = functools.partial(tensor_format, fmt, shape=s)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [_Tensor("token_embd.weight", fmt_of("token_embd", -1), (s.vocab, s.hidden), 0.002)]
    out.append(_Tensor("output_norm.weight", "F32", (s.hidden,)))
    if not s.tied:
        out.append(_Tensor("output.weight", fmt_of("output", -1), (s.vocab, s.hidden), 0.002))
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [_Tensor(p + "attn_norm.weight", "F32", (s.hidden,)),
                _Tensor(p + "ffn_norm.weight", "F32", (s.hidden,))]
        if s.arch == "qwen3moe":
            out += [_Tensor(p + "attn_q_norm.weight", "F32", (s.head_dim,)),
                    _Tensor(p + "attn_k_norm.weight", "F32", (s.head_dim,))]
        for role, n, k in (("attn_q", q, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden),
                           ("attn_output", s.hidden, q)):
            out.append(_Tensor(p + role + ".weight", fmt_of(role, i), (n, k), 0.004, role))
        if s.experts:
            e, f = s.experts, s.expert_ffn
            out.append(_Tensor(p + "ffn_gate_inp.weight", "F32", (e, s.hidden), 0.02, "router"))
            for role, n, k in (("ffn_gate_exps", f, s.hidden), ("ffn_up_exps", f, s.hidden),
                               ("ffn_down_exps", s.hidden, f)):
                out.append(_Tensor(p + role + ".weight", fmt_of(role, i), (e, n, k),
                                   0.002 if role == "ffn_down_exps" else 0.004, role))
        else:
            for role, n, k in (("ffn_gate", s.ffn, s.hidden), ("ffn_up", s.ffn, s.hidden),
                               ("ffn_down", s.hidden, s.ffn)):
                out.append(_Tensor(p + role + ".weight", fmt_of(role, i), (n, k),
                                   0.002 if role == "ffn_down" else 0.004, role))
    return out


def _data(t: _Tensor, seed: int) -> Any:
    """The tensor's bytes as numpy: float32 for F32, uint8 [..., row bytes] for a block format."""
    import numpy as np

    from chatserve_kernels.block_formats import random_weight

    if t.fmt == "F32":
        if not t.scale:
            return np.ones(t.dims, np.float32)
        return (np.random.default_rng(seed).standard_normal(t.dims) * t.scale).astype(np.float32)
    rows = int(np.prod(t.dims[:-1]))
    raw = random_weight(t.fmt, rows, t.dims[-1], seed=seed, scale=block_scale(t.fmt, t.scale)).data.numpy()
    return raw.reshape(*t.dims[:-1], raw.shape[-1])


def build_gguf(out: Path, fmt: str = "Q4_0", seed: int = 0, shape: str = "llama-3.2-1b",
               layers: int | None = None, **dims: int) -> Path:
    """Write the file at `out` (its tensors one at a time: the writer never holds more than one);
    fmt: a block format every matrix takes, or a mix in MIXES; layers / dims: override the shape's
    (a small variant for tests)."""
    import gguf
    import numpy as np

    from chatserve_kernels.block_formats import FORMATS

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    if fmt not in FORMATS and fmt not in MIXES:
        raise ValueError(f"format must be a block format ({', '.join(FORMATS)}) or one of {MIXES}")
    overrides: dict[str, Any] = {**dims, **({"layers": layers} if layers else {})}
    s = replace(SHAPES[shape], **overrides)
    plan = tensor_plan(s, fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), s.arch)
    w.add_tokenizer_model("no_vocab")        # llama.cpp loads it with no vocabulary (token ids only)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.vocab)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.expert_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if fmt in FILE_TYPES:
        w.add_file_type(FILE_TYPES[fmt])
    for t in plan:
        qtype = gguf.GGMLQuantizationType[t.fmt]
        if t.fmt == "F32":
            w.add_tensor_info(t.name, t.dims, np.dtype(np.float32), 4 * _count(t.dims))
        else:
            fb = FORMATS[t.fmt]
            row = t.dims[-1] // fb.block * fb.nbytes
            w.add_tensor_info(t.name, (*t.dims[:-1], row), np.dtype(np.uint8), row * _count(t.dims[:-1]),
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, t in enumerate(plan):
        w.write_tensor_data(_data(t, seed + 1 + i))
    w.close()
    return out


def _count(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chatserve bench build-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--format", default="Q4_0",
                   help="block format of every matrix (Q4_0, Q8_0, Q4_K, Q6_K, ...) or Q4_K_M (llama.cpp's mix: "
                        "Q6_K for output / a tied token_embd and for attn_v, ffn_down of the use_more_bits "
                        "layers, Q4_K elsewhere)")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    p.add_argument("--out", default=None, help="file (default: the chatserve cache's checkpoints/)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else default_path(args.format, args.shape, args.layers)
    print(build_gguf(out, args.format, args.seed, args.shape, args.layers))
    return 0
