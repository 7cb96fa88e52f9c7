"""Chained xxh3_128 block hashes: stability under a fixed seed, chaining, extra keys, seeds."""
import struct

import pytest
import xxhash

from chatserve.core.prefix_hash import ROOT_HASH, PrefixHasher


def chain(h: PrefixHasher, toks, e, **kw) -> list[bytes]:
    """The hashes the KV cache manager computes (iter_hashes: pack once, hash_packed per block)."""
    return list(h.iter_hashes(toks, e, **kw))


def test_golden_value_is_stable_across_processes_and_versions():
    # With hash_seed configured, hashes must survive restarts (and xxhash upgrades: XXH3 is frozen).
    h = PrefixHasher(4, seed=0)
    e = h.extra_key(None)
    assert e.hex() == "a4827a40f5c5a75d035039c8004247d4"
    assert [x.hex() for x in chain(h, [1, 2, 3, 4], e)] == ["07c93f14acc4ba5ce2aeeeb594d6fcbf"]


def test_block_input_is_parent_extra_and_uint32_tokens():
    h = PrefixHasher(4, seed=7)
    e = h.extra_key("s")
    parent = b"\x11" * 16
    raw = parent + e + struct.pack("<4I", 9, 8, 7, 6)
    assert chain(h, [9, 8, 7, 6], e, parent=parent) == [xxhash.xxh3_128_digest(raw, 7)]
    assert len(h.hash_packed(parent, h.pack([9, 8, 7, 6]), e)) == 16


def test_same_seed_same_hashes_different_seed_different():
    toks = list(range(40))
    a, b, c = PrefixHasher(8, seed=123), PrefixHasher(8, seed=123), PrefixHasher(8, seed=124)
    ha = chain(a, toks, a.extra_key(None))
    assert ha == chain(b, toks, b.extra_key(None))
    assert set(ha).isdisjoint(chain(c, toks, c.extra_key(None)))


def test_default_seed_is_random_per_instance():
    a, b = PrefixHasher(16), PrefixHasher(16)
    assert a.seed != b.seed
    toks = list(range(16))
    assert chain(a, toks, a.extra_key(None)) != chain(b, toks, b.extra_key(None))


def test_seed_is_reduced_to_64_bits():
    assert PrefixHasher(4, seed=-1).seed == 2**64 - 1
    assert PrefixHasher(4, seed=2**64 + 5).seed == 5


def test_chain_only_full_blocks_and_a_change_propagates_forward():
    h = PrefixHasher(4, seed=1)
    e = h.extra_key(None)
    toks = [0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0]      # 3 full blocks + 1 ragged token
    hs = chain(h, toks, e)
    assert len(hs) == 3
    # Iterated single-block hashing gives the same chain.
    parent, manual = ROOT_HASH, []
    for i in range(3):
        parent = h.hash_packed(parent, h.pack(toks[4 * i:4 * i + 4]), e)
        manual.append(parent)
    assert manual == hs
    # Resuming the chain mid-way.
    assert chain(h, toks, e, parent=hs[0], start_block=1) == hs[1:]
    assert chain(h, toks, e, start_block=0, num_blocks=2) == hs[:2]
    # Same tokens in block 2, different block 0 → every later hash differs.
    other = [1] + toks[1:]
    ho = chain(h, other, e)
    assert all(x != y for x, y in zip(hs, ho))
    # Identical block contents at different depths hash differently (the parent is chained).
    rep = [0, 1, 0, 1] * 3
    hr = chain(h, rep, e)
    assert len(set(hr)) == 3


def test_extra_keys_separate_salts_and_models():
    h = PrefixHasher(4, seed=2)
    toks = [5, 6, 7, 8]
    keys = [h.extra_key(None), h.extra_key("alice"), h.extra_key("bob"),
            h.extra_key(None, "model-b"), h.extra_key("ab", "c"), h.extra_key("a", "bc")]
    assert len(set(keys)) == len(keys)
    assert h.extra_key(None) == h.extra_key("")
    hashes = {chain(h, toks, k)[0] for k in keys}
    assert len(hashes) == len(keys)


@pytest.mark.parametrize("bs", [8, 16, 32])
def test_block_sizes(bs):
    h = PrefixHasher(bs, seed=3)
    toks = list(range(3 * bs + 1))
    assert len(chain(h, toks, h.extra_key(None))) == 3


def test_token_ids_must_fit_uint32_and_block_size_positive():
    h = PrefixHasher(2, seed=0)
    e = h.extra_key(None)
    assert len(chain(h, [0, 2**32 - 1], e)) == 1
    with pytest.raises(struct.error):
        chain(h, [0, 2**32], e)
    assert len(chain(h, [0, 1, 2], e)) == 1      # a ragged tail is not hashed
    with pytest.raises(ValueError):
        PrefixHasher(0)
