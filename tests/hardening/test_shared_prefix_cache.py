"""Operator-shared system prompts in the KV cache manager: blocks inside the shared prefix are hashed
without the owner's salt (shared across owners); every later block keeps it (isolated)."""
from __future__ import annotations

from chatserve.core.kv_cache_manager import KVCacheManager

BS = 4


def _run(kv: KVCacheManager, sid: str, tokens: list[int], salt: str, shared: int = 0) -> int:
    """Admit, compute the whole prompt, commit, free; returns the cached-token hit at admission."""
    hit = kv.add_seq(sid, tokens, salt, shared_prefix_tokens=shared)
    assert kv.allocate_slots(sid, len(tokens)) is not None
    kv.commit(sid, tokens, len(tokens))
    kv.check_integrity()
    kv.free(sid)
    kv.check_integrity()
    return hit


def test_shared_prefix_blocks_are_shared_and_the_rest_stays_salted():
    kv = KVCacheManager(64, BS, hash_seed=1)
    system = list(range(100, 110))            # 10 tokens: blocks 0 and 1 lie inside, block 2 straddles
    alice = system + list(range(500, 514))
    bob = system + list(range(500, 514))      # the same tokens after the system prompt too
    assert _run(kv, "a", alice, "salt-alice", shared=len(system)) == 0
    # another owner hits only the 2 blocks lying entirely inside the shared prompt
    assert _run(kv, "b", bob, "salt-bob", shared=len(system)) == 2 * BS
    # the same owner hits its whole chain (capped so one token is left to compute)
    assert _run(kv, "a2", alice, "salt-alice", shared=len(system)) == (len(alice) - 1) // BS * BS


def test_without_a_shared_prefix_owners_are_isolated_and_defaults_unchanged():
    kv = KVCacheManager(64, BS, hash_seed=1)
    toks = list(range(1, 30))
    assert _run(kv, "a", toks, "salt-alice") == 0
    assert _run(kv, "b", toks, "salt-bob") == 0
    assert _run(kv, "a2", toks, "salt-alice") == 28
    # a seq that marks a shared prefix does not hit an unshared owner's salted blocks
    assert _run(kv, "c", toks, "salt-carol", shared=16) == 0
    assert _run(kv, "d", toks, "salt-dave", shared=16) == 16


def test_unsalted_requests_and_commit_override_and_fork():
    kv = KVCacheManager(64, BS, hash_seed=1)
    toks = list(range(1, 22))
    # no salt: the shared count changes nothing (everything is already unsalted)
    assert _run(kv, "x", toks, None, shared=8) == 0
    assert _run(kv, "y", toks, None) == 20
    # commit(shared_prefix_tokens=...) applies to blocks hashed from then on
    kv2 = KVCacheManager(64, BS, hash_seed=1)
    kv2.add_seq("p", toks, "s1")
    kv2.allocate_slots("p", len(toks))
    kv2.commit("p", toks, len(toks), shared_prefix_tokens=8)
    kv2.fork("p", "child")                    # the child keeps the parent's shared-prefix setting
    kv2.check_integrity()
    kv2.free("p")
    kv2.free("child")
    assert _run(kv2, "q", toks, "s2", shared=8) == 8
