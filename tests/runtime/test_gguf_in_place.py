"""GGUF weights kept in place (--gguf-in-place) behind the LinearBackend seam: the loader hands out block
views of the mapped file (bit-equal to gguf-py's dequantization once decoded, Q/K rows in HF order), the
backend is chosen once (--cpu-isa), and a model on its own codes gives the dense model's logits with every
backend this CPU runs, the torch twin included, with no capability probe after load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_weights import GGUF_CFG, Q, write_tiny_gguf

from chatserve.config import CacheConfig, ModelConfig
from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
from chatserve.core.request import SamplingParams
from chatserve.runtime.model_runner import ModelRunner
from chatserve.runtime.models import linear_backends as lb
from chatserve.runtime.tiny import random_weights, tiny_config
from chatserve.runtime.weights import load_weights
from chatserve_kernels import block_formats, cpu_blockmm, cpu_blockq8

ISAS = ["torch"] + [isa for isa in cpu_blockmm.LEVELS if cpu_blockmm.supported(isa)]
TYPES = {
    "model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q6_K,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_0, "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": Q.F16, "model.layers.0.self_attn.o_proj.weight": Q.Q5_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_K, "model.layers.0.mlp.up_proj.weight": Q.Q5_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.q_proj.weight": Q.BF16, "model.layers.1.self_attn.k_proj.weight": Q.Q6_K,
    "model.layers.1.self_attn.v_proj.weight": Q.Q8_0, "model.layers.1.self_attn.o_proj.weight": Q.F32,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_0, "model.layers.1.mlp.up_proj.weight": Q.Q4_0,
    "model.layers.1.mlp.down_proj.weight": Q.Q4_K,
}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = tiny_config("llama", **{**GGUF_CFG, "num_hidden_layers": 2})
    path = tmp_path_factory.mktemp("inplace") / "tiny.gguf"
    encoded = write_tiny_gguf(path, cfg, random_weights(cfg, seed=3), TYPES)
    return str(path), encoded


def mapped(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def test_matrices_stay_blocks_of_the_mapped_file(tiny_gguf):
    path, encoded = tiny_gguf
    got = load_weights(path, "float32", progress=False, in_place=True)
    maps = mapped(path)
    assert maps
    blocks = {n: t for n, t in got.tensors.items() if isinstance(t, lb.BlockMatrix)}
    assert set(blocks) == set(TYPES)
    for name, m in blocks.items():
        (part,) = m.parts
        assert part.fmt.type_id == int(TYPES[name])
        # decoded, the blocks are exactly what gguf-py reads from the file (Q/K rows back in HF order)
        assert np.array_equal(block_formats.dequantize(part).numpy(), encoded[name]), name
        if ".q_proj." not in name and ".k_proj." not in name:       # a view of the map, not a copy
            start = part.data.data_ptr()
            assert any(lo <= start and start + part.nbytes() <= hi for lo, hi in maps), name
    assert all(isinstance(t, torch.Tensor) and t.dim() == 1 for n, t in got.tensors.items() if n not in blocks)


def test_the_backend_is_chosen_once_and_a_level_this_cpu_lacks_is_an_error():
    cpu = torch.device("cpu")
    best = lb.choose_block_backend(cpu, "auto")
    assert best.name == ("cpu-" + ISAS[-1] if len(ISAS) > 1 else "torch")
    assert lb.choose_block_backend(cpu, "torch") is lb.TorchBlockLinear
    assert lb.choose_block_backend(torch.device("meta"), "auto") is lb.TorchBlockLinear
    for isa in cpu_blockmm.LEVELS:
        if isa in ISAS:
            assert lb.choose_block_backend(cpu, isa).name == f"cpu-{isa}"
        else:
            with pytest.raises(ValueError, match="cannot run"):
                lb.choose_block_backend(cpu, isa)
    with pytest.raises(ValueError, match="cpu_isa"):
        lb.choose_block_backend(cpu, "sse2")


def _runner(path: str, in_place: bool, isa: str = "auto") -> ModelRunner:
    model = ModelConfig(model=path, dtype="float32", device="cpu", weight_quant=None, num_threads=1,
                        gguf_in_place=in_place, cpu_isa=isa)
    return ModelRunner(model, CacheConfig(num_blocks=64, block_size=16), progress=False)


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a 2-sequence prefill and 4 decode steps with fixed inputs."""
    seen: list[torch.Tensor] = []
    fn = runner.model.compute_logits
    runner.model.compute_logits = lambda h: seen.append(fn(h).clone()) or seen[-1]
    try:
        prompts = [[(7 * i + 3 * b) % 500 + 1 for i in range(19 + 6 * b)] for b in range(2)]
        tables = [list(range(8 * b, 8 * b + 8)) for b in range(2)]
        runner.execute(SchedulerOutput(1, [ScheduledSeq(f"s{b}", p, 0, tables[b], True, GREEDY, p)
                                           for b, p in enumerate(prompts)]))
        for i in range(4):
            runner.execute(SchedulerOutput(2 + i, [ScheduledSeq(f"s{b}", [(31 * i + b) % 500 + 1],
                                                                len(prompts[b]) + i, tables[b], True, GREEDY,
                                                                prompts[b])
                                                   for b in range(2)]))
    finally:
        del runner.model.compute_logits
    return seen


@pytest.fixture(scope="module")
def dense_logits(tiny_gguf):
    return _logits(_runner(tiny_gguf[0], in_place=False))


@pytest.fixture(scope="module")
def twin_logits(tiny_gguf):
    return _logits(_runner(tiny_gguf[0], in_place=True, isa="torch"))


@pytest.mark.parametrize("isa", ISAS)
def test_a_model_on_its_own_codes_gives_the_dense_logits(tiny_gguf, dense_logits, twin_logits, isa, monkeypatch):
    runner = _runner(tiny_gguf[0], in_place=True, isa=isa)
    assert runner.block_backend.name == (isa if isa == "torch" else f"cpu-{isa}")
    lins = [runner.model.lm_head] + [m for ly in runner.model.layers for m in (ly.qkv, ly.o, ly.mlp.gate_up,
                                                                                ly.mlp.down)]
    assert all(type(m) is runner.block_backend for m in lins)
    assert len(runner.model.layers[0].qkv.w.parts) == 3        # q, k, v stay three tensors of the file
    assert f"linears {runner.block_backend.name} on the file's blocks" in runner.model.describe_backends()

    def probe(*a, **k):
        raise AssertionError("capability probe after load")
    monkeypatch.setattr(cpu_blockmm, "supported", probe)
    monkeypatch.setattr(cpu_blockmm, "cpu_flags", probe)
    monkeypatch.setattr(cpu_blockq8, "available", probe)
    monkeypatch.setattr(cpu_blockq8, "supported", probe)
    monkeypatch.setattr(lb, "choose_block_backend", probe)
    got = _logits(runner)
    assert len(got) == len(dense_logits) == len(twin_logits) == 5
    for i, (a, b, t) in enumerate(zip(got, dense_logits, twin_logits)):
        assert a.abs().sum() > 0
        scale = float(b.abs().max())                    # this random model's logits reach ~800
        # the twin's arithmetic: prompt rows float32 dots in another order, generated rows and the LM head the
        # same integer dots (a float difference upstream may move one 15-bit x code by one step)
        torch.testing.assert_close(a, t, rtol=0, atol=1e-3 * scale)
        # the dense model: within the 15-bit rounding of x in the decode rows and the head (measured ≤ 5e-4)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3 * scale)


# llama.cpp's Q4_K_M mix (the commonest GGUF on CPUs): Q4_K, with Q6_K for the LM head, v and some down bands
Q4_K_M = {**{n: Q.Q4_K for n in TYPES}, "lm_head.weight": Q.Q6_K, "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,
          "model.layers.1.self_attn.v_proj.weight": Q.Q6_K, "model.layers.0.mlp.down_proj.weight": Q.Q6_K}


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory) -> str:
    cfg = tiny_config("llama", **{**GGUF_CFG, "num_hidden_layers": 2})
    path = tmp_path_factory.mktemp("inplace_k") / "tiny-q4_k_m.gguf"
    write_tiny_gguf(path, cfg, random_weights(cfg, seed=5), Q4_K_M)
    return str(path)


# the backend levels that tile their decode bands on this CPU (AVX2 and AVX-512 both do): not a skip
TILED_ISAS = [isa for isa in ISAS if isa in cpu_blockq8.TILED_ISAS and cpu_blockq8.available(isa)]


@pytest.mark.parametrize("isa", TILED_ISAS)
def test_a_q4_k_m_model_decodes_on_tiled_copies_with_the_dense_logits(q4_k_m_gguf, isa):
    """At every level with the tiled kernel (AVX2, AVX-512) every dense band and the LM head of a Q4_K_M file
    runs its decode rows on a tiled copy (Q4_K q and k one call, Q6_K v its own; gate and up one call): the
    logits are the dense model's within the 15-bit rounding of x and the twin's, and the C decode chain gives
    the layer loop's bits."""
    runner = _runner(q4_k_m_gguf, in_place=True, isa=isa)
    lins = [runner.model.lm_head] + [m for ly in runner.model.layers for m in (ly.qkv, ly.o, ly.mlp.gate_up,
                                                                                ly.mlp.down)]
    assert all(isinstance(w, cpu_blockq8.TiledWeight) for m in lins for _, w in m.decode_calls)
    qkv, gate_up = runner.model.layers[0].qkv, runner.model.layers[0].mlp.gate_up
    assert [w.fmt.name for _, w in qkv.decode_calls] == ["Q4_K", "Q6_K"] and len(gate_up.decode_calls) == 1
    assert runner.model.chain is not None
    got = _logits(runner)
    runner.model.chain = None
    assert all(torch.equal(a, b) for a, b in zip(got, _logits(runner)))        # chain = layer loop, bit for bit
    dense = _logits(_runner(q4_k_m_gguf, in_place=False))
    twin = _logits(_runner(q4_k_m_gguf, in_place=True, isa="torch"))
    assert len(got) == len(dense) == len(twin) == 5
    for a, b, t in zip(got, dense, twin):
        scale = float(b.abs().max())
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, t, rtol=0, atol=1e-3 * scale)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3 * scale)
