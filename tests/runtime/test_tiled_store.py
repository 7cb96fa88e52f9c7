"""The tiled copies of a GGUF kept on disk (kernels/tiled_store.py, issue 30): the first in-place load writes one
cache file per model file, a second load maps it instead of tiling, a corrupt file is built again, and the
logits are the same bits cached or not."""
from __future__ import annotations

import os

import pytest
import torch
from test_gguf_in_place import Q4_K_M, TILED_ISAS, _logits, _runner, mapped
from test_weights import GGUF_CFG, write_tiny_gguf

from chatserve.runtime.tiny import random_weights, tiny_config
from chatserve_kernels import cpu_blockq8, env, tiled_store
from chatserve_kernels.block_formats import RowOrderedWeight

pytestmark = pytest.mark.skipif(not TILED_ISAS, reason="no tiled kernel level on this CPU")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(env.WEIGHT_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(env.WEIGHT_CACHE, "1")
    return tmp_path / "cache"


@pytest.fixture
def gguf(tmp_path) -> str:
    cfg = tiny_config("llama", **{**GGUF_CFG, "num_hidden_layers": 2})
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_tiny_gguf(path, cfg, random_weights(cfg, seed=7), Q4_K_M)
    return str(path)


def _tiled(runner) -> list[cpu_blockq8.TiledWeight]:
    lins = [runner.model.lm_head] + [m for ly in runner.model.layers
                                     for m in (ly.qkv, ly.o, ly.mlp.gate_up, ly.mlp.down)]
    return [w for m in lins for _, w in m.decode_calls if isinstance(w, cpu_blockq8.TiledWeight)]


def _qk_bands(runner) -> list[RowOrderedWeight]:
    """The Q and K bands (the file's rows read in HF order) of every layer."""
    return [p for ly in runner.model.layers for p in ly.qkv.w.parts if isinstance(p, RowOrderedWeight)]


def _in(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.numel() <= hi for lo, hi in ranges)


def test_a_second_load_maps_the_cache_file_and_gives_the_same_bits(cache, gguf, monkeypatch):
    isa = TILED_ISAS[-1]
    monkeypatch.setenv(env.WEIGHT_CACHE, "0")
    plain = _runner(gguf, in_place=True, isa=isa)
    assert not cache.exists() and all(not _in(w.data, mapped(str(cache))) for w in _tiled(plain))
    want = _logits(plain)
    monkeypatch.setenv(env.WEIGHT_CACHE, "1")
    first = _runner(gguf, in_place=True, isa=isa)
    files = list(cache.glob("tiled-*.bin"))
    assert len(files) == 1 and not list(cache.glob("*.tmp"))           # one file per model file, published
    runs = _tiled(first)
    assert all(_in(w.data, mapped(str(files[0]))) for w in runs)      # tiled straight into the file's pages
    first_logits = _logits(first)
    assert len(_qk_bands(first)) == 4 and all(p._copy is None for p in _qk_bands(first))  # tiled: copy dropped
    copies: list[RowOrderedWeight] = []             # Q/K rows copied into HF order: none on a warm load
    reorder = RowOrderedWeight.data.fget
    monkeypatch.setattr(RowOrderedWeight, "data", property(lambda w: copies.append(w) or reorder(w)))
    sampled: list[object] = []                      # nor a row of the GGUF read for a run's key
    sample = tiled_store._band_sample
    monkeypatch.setattr(tiled_store, "_band_sample", lambda w: sampled.append(w) or sample(w))
    second = _runner(gguf, in_place=True, isa=isa)
    assert copies == [] and sampled == [] and len(_qk_bands(second)) == 4
    store = second.model.lm_head.w.store
    assert store is not None and store.mapped and store.built == 0     # nothing tiled: the file is mapped
    again = _tiled(second)
    assert all(_in(w.data, mapped(str(files[0]))) for w in again)
    assert [torch.equal(a.data, b.data) for a, b in zip(runs, again)] == [True] * len(runs)
    for got in (first_logits, _logits(second)):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("damage", ["truncate", "footer", "index"])
def test_a_corrupt_cache_file_is_built_again(cache, gguf, damage):
    isa = TILED_ISAS[-1]
    want = _logits(_runner(gguf, in_place=True, isa=isa))
    (path,) = cache.glob("tiled-*.bin")
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "footer":
        raw[-20:] = bytes(20)
    else:                                   # the index points past the data
        at = int.from_bytes(raw[-16:-8], "little")
        raw[at:at + 1] = b"?"
    path.write_bytes(bytes(raw))
    runner = _runner(gguf, in_place=True, isa=isa)
    store = runner.model.lm_head.w.store
    assert store is not None and store.built > 0            # tiled again into a new file (then mapped)
    assert len(path.read_bytes()) > len(raw) // 2 and tiled_store.TiledStore(path, store.source).mapped
    got = _logits(runner)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_changed_model_file_gets_a_new_cache_file_and_the_old_one_goes(cache, gguf):
    isa = TILED_ISAS[-1]
    _runner(gguf, in_place=True, isa=isa)
    (old,) = cache.glob("tiled-*.bin")
    cfg = tiny_config("llama", **{**GGUF_CFG, "num_hidden_layers": 2})
    write_tiny_gguf(gguf, cfg, random_weights(cfg, seed=8), Q4_K_M)      # rewritten in place: new mtime
    runner = _runner(gguf, in_place=True, isa=isa)
    (new,) = cache.glob("tiled-*.bin")
    store = runner.model.lm_head.w.store
    assert new != old and store is not None and store.built > 0


def _prefill_hidden(runner) -> torch.Tensor:
    """The hidden rows a 2-sequence prefill hands to the LM head (the logits' input: the head's own arithmetic
    is the decode rows', whichever layout it reads)."""
    seen: list[torch.Tensor] = []
    fn = runner.model.compute_logits
    runner.model.compute_logits = lambda h: seen.append(h.clone()) or fn(h)
    try:
        _logits(runner)
    finally:
        runner.model.compute_logits = fn
    return seen[0]


@pytest.mark.parametrize("isa", TILED_ISAS)
def test_prompt_rows_read_the_tiled_copy_with_the_files_bits_and_leave_its_pages_alone(cache, gguf, isa,
                                                                                       monkeypatch):
    """Prompt rows on the tiled runs (cpu_blockmm's tiled source) give the hidden rows of prompt rows on the
    file's bands bit for bit; after load the GGUF's map keeps few resident pages (released; the tiled bands'
    are not read again by a prefill and decode steps)."""
    from chatserve.runtime.models import linear_backends as lb
    tiled = _runner(gguf, in_place=True, isa=isa)
    h = _prefill_hidden(tiled)
    lins = [tiled.model.lm_head] + [m for ly in tiled.model.layers for m in (ly.qkv, ly.o, ly.mlp.gate_up, ly.mlp.down)]
    banded = sum(p.nbytes() for m in lins for p in m.w.parts)
    assert 0 < banded and _map_rss(gguf) < banded // 4
    monkeypatch.setattr(lb, "TILED_DECODE", False)
    plain = _runner(gguf, in_place=True, isa=isa)
    assert not plain.model.layers[0].qkv.tiled and tiled.model.layers[0].qkv.tiled
    assert torch.equal(h, _prefill_hidden(plain))


def _map_rss(path: str) -> int:
    """Resident bytes of this process's maps of `path` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(head[1]) * 1024
    return rss


def test_a_dead_builders_temporary_file_is_removed_and_a_live_ones_kept(cache, gguf):
    cache.mkdir(parents=True)
    store = tiled_store.TiledStore.for_file(gguf)
    assert store is not None
    dead, live = (cache / f"{store.path.name}.{pid}.1.tmp" for pid in (2 ** 22 + 1, os.getpid()))
    for f in (dead, live):
        f.write_bytes(b"partial")
    _runner(gguf, in_place=True, isa=TILED_ISAS[-1])
    assert not dead.exists() and live.exists() and store.path.exists()


def test_a_second_model_from_the_same_loaded_weights_maps_the_published_file(cache, gguf):
    from chatserve.config import CacheConfig, ModelConfig
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.runtime.weights import load_weights
    isa = TILED_ISAS[-1]
    weights = load_weights(gguf, "float32", progress=False, in_place=True)
    model = ModelConfig(model=gguf, dtype="float32", device="cpu", weight_quant=None, num_threads=1,
                        gguf_in_place=True, cpu_isa=isa)
    runners = [ModelRunner(model, CacheConfig(num_blocks=64, block_size=16), progress=False, weights=weights)
               for _ in range(2)]
    store = weights.tiled_store
    assert store is not None and store.mapped and not store.stale and len(list(cache.glob("tiled-*.bin"))) == 1
    assert all(torch.equal(a, b) for a, b in zip(*(_logits(r) for r in runners)))


def test_a_run_key_names_the_bands_place_in_the_file_and_its_row_order(cache, gguf):
    """Bands over the GGUF's map are keyed by offset and row order, not by sampled rows: a head permutation
    keeps a Q matrix's first, middle and last rows where they were, so sampled rows could not tell the file's
    order from HF's; the key can."""
    from chatserve.runtime.weights import block_matrix, gguf_reader
    reader = gguf_reader(gguf)
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    heads = GGUF_CFG["num_attention_heads"]
    as_file, as_hf = block_matrix(q).parts[0], block_matrix(q, heads).parts[0]
    assert [torch.equal(as_file.row(r), as_hf.row(r)) for r in (0, q.shape[1] // 2, q.shape[1] - 1)] == [True] * 3
    store = tiled_store.TiledStore.for_file(gguf, (int(reader.data.ctypes.data), int(reader.data.nbytes)))
    assert store is not None
    keys = {store._key([w]) for w in (as_file, as_hf)}
    assert len(keys) == 2
    store.file_span = None                          # keyed by sampled rows: the two orders collide
    assert len({store._key([w]) for w in (as_file, as_hf)}) == 1
