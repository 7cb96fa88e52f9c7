"""Chained prefix hashes of full KV blocks: h_i = xxh3_128(h_{i-1} ‖ extra ‖ tokens of block i; seed).

Pure bookkeeping: it names block contents, it never stores or compares them (see docs/kv-cache.md for
why a 128-bit collision is ruled out by probability rather than checked).
"""
from __future__ import annotations

import secrets
import struct
from collections.abc import Iterator, Sequence

import xxhash

BlockHash = bytes          # 16-byte xxh3_128 digest
ROOT_HASH: BlockHash = b"\x00" * 16   # the "parent" of block 0
_MASK64 = (1 << 64) - 1


def random_seed() -> int:
    """A fresh 64-bit process seed (used when no hash_seed is configured)."""
    return secrets.randbits(64)


class PrefixHasher:
    """Hashes full blocks of `block_size` token ids into a chain.

    Input of one block, little-endian and fixed-size, so no two different inputs share an encoding:

        parent digest (16 B) | extra-key digest (16 B) | block_size × uint32 token ids

    `extra` is the digest of the per-sequence extra keys (cache salt, model/adapter key): it enters
    every block, so two salts never produce the same hash even for identical tokens.
    """

    def __init__(self, block_size: int, seed: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.seed: int = random_seed() if seed is None else (seed & _MASK64)
        self._extra_cache: dict[tuple[str, str], bytes] = {}

    def extra_key(self, cache_salt: str | None, model_key: str = "") -> bytes:
        """Digest of the extra keys. `None` and "" salts are the same (no salt)."""
        key = (cache_salt or "", model_key)
        d = self._extra_cache.get(key)
        if d is None:
            # Length-prefixed so ("ab", "c") and ("a", "bc") differ.
            s, m = key[0].encode(), key[1].encode()
            raw = b"chatserve-kv\x00" + struct.pack("<II", len(s), len(m)) + s + m
            d = xxhash.xxh3_128_digest(raw, self.seed)
            if len(self._extra_cache) < 65536:
                self._extra_cache[key] = d
        return d

    @staticmethod
    def pack(token_ids: Sequence[int]) -> bytes:
        """token_ids as little-endian uint32 (the block encoding; pack once, slice per block)."""
        return struct.pack(f"<{len(token_ids)}I", *token_ids)

    def hash_packed(self, parent: BlockHash, packed_block: bytes, extra: bytes) -> BlockHash:
        """Hash of one full block packed with pack() (4 * block_size bytes) under its parent's hash."""
        return xxhash.xxh3_128_digest(parent + extra + packed_block, self.seed)

    def iter_hashes(self, token_ids: Sequence[int], extra: bytes, parent: BlockHash = ROOT_HASH,
                    start_block: int = 0, num_blocks: int | None = None) -> Iterator[BlockHash]:
        """Chained hashes of full blocks start_block.. of token_ids (parent = hash of block
        start_block-1), computed lazily so a prefix lookup stops hashing at its first miss."""
        bs = self.block_size
        end = len(token_ids) // bs if num_blocks is None else min(len(token_ids) // bs,
                                                                   start_block + num_blocks)
        if end <= start_block:
            return
        buf = self.pack(token_ids[start_block * bs:end * bs])
        stride = 4 * bs
        for off in range(0, len(buf), stride):
            parent = self.hash_packed(parent, buf[off:off + stride], extra)
            yield parent
