"""The model on the paged cache: a sequence scattered over random non-contiguous blocks (chunked
prefill, then decodes) gives the logits of one contiguous pass; a mixed varlen batch equals each
sequence alone. Default model, fp32."""
from __future__ import annotations

import random

import pytest
import torch

from chatserve.runtime.kv_cache import allocate_kv_caches
from chatserve_kernels import AttentionMetadata


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def run_step(model, kv, chunks: list[tuple[list[int], int, list[int]]], block_size: int) -> torch.Tensor:
    """One forward over chunks (token_ids, start_pos, block_table) → logits [T, V] of every token."""
    ids, pos = [], []
    for toks, start, _ in chunks:
        ids += toks
        pos += list(range(start, start + len(toks)))
    meta = AttentionMetadata.build([len(t) for t, _, _ in chunks], [s + len(t) for t, s, _ in chunks],
                                   [bt for _, _, bt in chunks], block_size)
    with torch.inference_mode():
        h = model.forward(torch.tensor(ids), torch.tensor(pos), kv, meta)
        return model.compute_logits(h)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(49152) for _ in range(45)]


@pytest.fixture(scope="module")
def reference(default_model, contiguous_forward, tokens) -> torch.Tensor:
    return contiguous_forward(default_model, tokens)          # [45, V]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_scattered_blocks_equal_contiguous(default_model, reference, tokens, block_size):
    n_blocks = -(-len(tokens) // block_size)
    pool = 3 * n_blocks + 1
    rng = random.Random(block_size)
    table = rng.sample(range(pool), n_blocks)                  # random, non-contiguous, unordered
    if table == sorted(table):
        table.reverse()                                        # keep it out of order
    kv = allocate_kv_caches(default_model.config, block_size, torch.float32, num_blocks=pool)
    got = {}
    # prefill in two chunks (the second attends to the first through the cache), then decodes
    for start, end in [(0, 17), (17, 40)] + [(p, p + 1) for p in range(40, 45)]:
        logits = run_step(default_model, kv, [(tokens[start:end], start, table)], block_size)
        for i, p in enumerate(range(start, end)):
            got[p] = logits[i]
    for p in (16, 39, 40, 44):
        assert rel_err(got[p], reference[p]) < 1e-4, p
        assert int(got[p].argmax()) == int(reference[p].argmax())


def test_varlen_batch_equals_each_alone(default_model, contiguous_forward):
    rng = random.Random(3)
    seqs = [[rng.randrange(49152) for _ in range(n)] for n in (30, 21, 10)]
    bs = 16
    kv = allocate_kv_caches(default_model.config, bs, torch.float32, num_blocks=12)
    tables = [[5, 2], [9, 0], [7]]
    # cached prefixes: A has 12 tokens, B 20, C 9 (computed earlier, one sequence at a time)
    cached = [12, 20, 9]
    for s, c, t in zip(seqs, cached, tables):
        run_step(default_model, kv, [(s[:c], 0, t)], bs)
    # one mixed step: A prefills a chunk of 18, B and C decode one token each
    chunks = [(s[c:], c, t) for s, c, t in zip(seqs, cached, tables)]
    assert [len(ch[0]) for ch in chunks] == [18, 1, 1]
    batched = run_step(default_model, kv, chunks, bs)
    alone = [contiguous_forward(default_model, s) for s in seqs]
    assert rel_err(batched[:18], alone[0][12:]) < 1e-4
    assert rel_err(batched[18], alone[1][-1]) < 1e-4
    assert rel_err(batched[19], alone[2][-1]) < 1e-4


def test_decode_only_batch_equals_each_alone(default_model, contiguous_forward):
    rng = random.Random(4)
    seqs = [[rng.randrange(49152) for _ in range(n)] for n in (5, 33, 17)]
    bs = 16
    kv = allocate_kv_caches(default_model.config, bs, torch.float32, num_blocks=10)
    tables = [[8], [1, 6, 3], [0, 9]]
    for s, t in zip(seqs, tables):
        run_step(default_model, kv, [(s[:-1], 0, t)], bs)
    batched = run_step(default_model, kv, [(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)], bs)
    for i, s in enumerate(seqs):
        assert rel_err(batched[i], contiguous_forward(default_model, s)[-1]) < 1e-4
