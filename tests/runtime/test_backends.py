"""Backends are chosen once: after load, no capability probe runs on the step path (issue 29), and the
default model at its default settings picks the C attention and cpu_qmatmul where this CPU builds them."""
from __future__ import annotations

import pytest

from chatserve.config import default_model_path
from chatserve.core.request import SamplingParams
from chatserve.engine.llm import LLM
from chatserve.runtime.models import layers, linear_backends
from chatserve_kernels import attention, attention_backend, block_copy, cpu_attention, cpu_blockmm, cpu_blockq8
from chatserve_kernels import cpu_build
from chatserve_kernels import cpu_decode, cpu_ops, cpu_qmatmul, dispatch, env, kv_store

# every capability probe: CPU features, compiled-kernel availability, Triton's switch, the backend choices
PROBES = [(cpu_attention, "available"), (cpu_attention, "supports"), (cpu_qmatmul, "available"),
          (cpu_ops, "usable"), (cpu_decode, "usable"), (attention_backend, "use_triton"),
          (attention, "use_triton"), (attention, "flash_supported"), (kv_store, "use_triton"),
          (block_copy, "use_triton"), (layers, "_onednn_packs"), (attention_backend, "pick_attention_backend"),
          (cpu_blockmm, "available"), (cpu_blockmm, "supported"), (cpu_blockmm, "detect_isa"),
          (cpu_blockq8, "available"), (cpu_blockq8, "supported"), (cpu_blockq8, "uses_vnni"),
          (cpu_build, "cpu_flags"), (cpu_build, "missing_flags"), (cpu_build, "compiler"),
          (dispatch, "use_triton"), (env, "force_triton"), (env, "cpu_kernels_enabled"),
          (linear_backends, "choose_block_backend"), (linear_backends.CpuBlockLinear, "usable")]


@pytest.mark.skipif(default_model_path() is None, reason="default model not installed")
@pytest.mark.parametrize("settings", [{"weight_quant": "auto"}, {"gguf_in_place": True}],
                         ids=["int4", "gguf-in-place"])
def test_no_capability_probe_runs_per_step(monkeypatch, settings):
    llm = LLM(None, dtype="auto", num_blocks=96, max_num_batched_tokens=48, **settings)
    prompts = [list(range(200, 290)), list(range(300, 310)), list(range(400, 403))]   # chunked, mixed steps
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert [len(t) for t in first] == [12, 12, 12]
    backend = llm.runner.model.attention_backend
    assert backend is not None
    if cpu_attention.available():
        assert backend.name == "cpu-c"
    if settings.get("gguf_in_place") and cpu_blockmm.detect_isa():
        assert llm.runner.block_formats and llm.runner.block_backend.name.startswith("cpu-")

    def boom(*a, **k):
        raise AssertionError("a capability probe ran on the step path")
    for mod, name in PROBES:
        monkeypatch.setattr(mod, name, boom)
    again = llm.generate(prompts, params)
    assert again == first            # and batch-invariant: the prefix-cache hits and other steps change nothing


@pytest.mark.skipif(default_model_path() is None, reason="default model not installed")
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("in_place", [False, True], ids=["dense", "gguf-in-place"])
def test_batch_invariant_flag_chooses_the_row_split(linear_rows, invariant, in_place):
    """--batch-invariant (default on) hands every Linear the step's RowSplit, so a mixed step sends its
    generated rows and its prompt rows down different kernels; --no-batch-invariant hands none, and the
    Linear picks by step size (the throughput-first choice of earlier releases)."""
    llm = LLM(None, dtype="auto", weight_quant="auto", num_blocks=96, max_num_batched_tokens=48,
              batch_invariant=invariant, gguf_in_place=in_place)
    assert bool(llm.runner.block_formats) is in_place
    assert llm.runner.batch_invariant is invariant
    prompts = [list(range(300, 303)), list(range(200, 290))]   # the long one's chunks run beside the short's decodes
    out = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [len(t) for t in out] == [8, 8]
    assert linear_rows, "no Linear ran"
    mixed = [r for r in linear_rows if r is not None and not r.all_gen and r.gen is not None]
    if invariant:
        assert None not in linear_rows and mixed, "no mixed step reached the Linears with its row split"
    else:
        assert set(linear_rows) == {None}
