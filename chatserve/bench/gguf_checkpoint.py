"""`chatserve bench build-gguf`: a random-weight GGUF of the Llama-3.2-1B shape (16 layers, hidden 2048,
ffn 8192, 32/8 heads, Llama 3's 128,256-token vocabulary, tied embeddings) with every matrix in one block
format, written from random blocks (block_formats.random_weight: every code, finite scales) in seconds, for
load-time, RSS, speed and quality figures of GGUF weights (issue 30), here and in llama.cpp. Not a model anyone
can talk to (no tokenizer: `tokenizer.ggml.model` is llama.cpp's "no_vocab").
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

H, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 8192, 16, 32, 8, 128256


def default_path(fmt: str) -> Path:
    from chatserve.disk_cache import cache_dir

    return cache_dir("checkpoints") / f"llama-3.2-1b-random-{fmt}.gguf"


def build_gguf(out: Path, fmt: str = "Q4_0", seed: int = 0) -> Path:
    import gguf
    import numpy as np

    from chatserve_kernels.block_formats import random_weight

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("no_vocab")        # llama.cpp loads it with no vocabulary (token ids only)
    settings: tuple[tuple[Callable[[Any], None], Any], ...] = (
        (w.add_block_count, LAYERS), (w.add_context_length, 131072), (w.add_embedding_length, H),
        (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
        (w.add_rope_freq_base, 500000.0), (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, VOCAB))
    for add, value in settings:
        add(value)
    qtype = gguf.GGMLQuantizationType[fmt]
    count = [seed]

    def matrix(name: str, n: int, k: int, scale: float = 0.004) -> None:
        count[0] += 1
        raw = random_weight(fmt, n, k, seed=count[0], scale=scale).data.numpy()
        w.add_tensor(name, raw, raw_dtype=qtype)

    kv = KV_HEADS * H // HEADS
    matrix("token_embd.weight", VOCAB, H, 0.002)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, np.float32))
        for name, n, k in (("attn_q", H, H), ("attn_k", kv, H), ("attn_v", kv, H), ("attn_output", H, H),
                           ("ffn_gate", FFN, H), ("ffn_up", FFN, H), ("ffn_down", H, FFN)):
            matrix(p + name + ".weight", n, k, 0.002 if name == "ffn_down" else 0.004)
    out.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chatserve bench build-gguf", description=__doc__)
    p.add_argument("--format", default="Q4_0", help="block format of every matrix (Q4_0, Q8_0, Q4_K, ...)")
    p.add_argument("--out", default=None, help="file (default: the chatserve cache's checkpoints/)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(build_gguf(Path(args.out) if args.out else default_path(args.format), args.format, args.seed))
    return 0
