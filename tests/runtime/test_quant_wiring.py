"""weight_quant / kv_cache_dtype travel from flags and CHATSERVE_* variables to the ModelRunner."""
from __future__ import annotations

import pytest

from chatserve.config import EngineConfig
from chatserve.engine import AsyncEngine


def test_env_sets_weight_quant_and_none_clears_it():
    assert EngineConfig.from_env({}).model.weight_quant == "auto"
    assert EngineConfig.from_env({"CHATSERVE_WEIGHT_QUANT": "int4"}).model.weight_quant == "int4"
    assert EngineConfig.from_env({"CHATSERVE_WEIGHT_QUANT": "none"}).model.weight_quant is None
    assert EngineConfig.from_env({"CHATSERVE_KV_CACHE_DTYPE": "int8"}).cache.kv_cache_dtype == "int8"


def test_serve_flags_reach_the_config():
    from chatserve.server.serve import build_parser, config_from_args
    env = EngineConfig.from_env({"CHATSERVE_WEIGHT_QUANT": "int8"})
    p = build_parser(env)
    cfg = config_from_args(p.parse_args(["--weight-quant", "int4", "--kv-cache-dtype", "fp8"]), env)
    assert (cfg.model.weight_quant, cfg.cache.kv_cache_dtype) == ("int4", "fp8")
    assert config_from_args(p.parse_args([]), env).model.weight_quant == "int8"    # env default
    assert config_from_args(p.parse_args(["--weight-quant", "none"]), env).model.weight_quant is None
    with pytest.raises(SystemExit):
        p.parse_args(["--weight-quant", "int3"])


def test_engine_load_passes_both_to_the_runner(monkeypatch):
    import chatserve.runtime.model_runner as mr
    seen = {}

    class StubRunner:
        def __init__(self, model, cache):
            seen.update(weight_quant=model.weight_quant, kv_cache_dtype=cache.kv_cache_dtype)
            self.num_blocks, self.max_model_len, self.block_size = 8, 64, 16
            self.model_path, self.model_key, self.kv_window = model.model, "stub", None
            self.vocab_size, self.eos_token_ids, self.kv_cache_dtype = 64, (), cache.kv_cache_dtype

        @classmethod
        def from_config(cls, config, **kw):                # the builder's one call: the whole config
            return cls(config.model, config.cache)

        def warm_up(self) -> float:
            return 0.0
    monkeypatch.setattr(mr, "ModelRunner", StubRunner)
    from dataclasses import replace
    base = EngineConfig()
    cfg = replace(base, model=replace(base.model, model="/nonexistent.gguf", weight_quant="int4"),
                  cache=replace(base.cache, kv_cache_dtype="int8"))
    eng = AsyncEngine(cfg, tokenizer=object())
    eng.load()
    assert seen["weight_quant"] == "int4" and seen["kv_cache_dtype"] == "int8"


def test_auto_picks_int4_for_the_4bit_default_model_on_cpu(default_weights):
    import torch
    from chatserve.runtime.model_runner import auto_weight_quant
    assert default_weights.four_bit                                   # SmolLM2 Q4_1 GGUF
    assert auto_weight_quant(default_weights, torch.device("cpu")) == "int4"
    assert auto_weight_quant(default_weights, torch.device("cuda")) is None


def test_auto_keeps_dense_weights_for_a_float_checkpoint(tmp_path):
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.runtime.tiny import make_tiny_model
    path = make_tiny_model(tmp_path / "tiny")
    r = ModelRunner.from_config(offline_config(str(path), num_blocks=8, weight_quant="auto"))
    assert r.weight_quant is None


def test_gguf_in_place_is_a_flag_whose_unset_value_is_auto():
    from chatserve.server.serve import build_parser, config_from_args
    assert EngineConfig.from_env({}).model.gguf_in_place is None
    assert EngineConfig.from_env({"CHATSERVE_GGUF_IN_PLACE": "true"}).model.gguf_in_place is True
    assert EngineConfig.from_env({"CHATSERVE_GGUF_IN_PLACE": "0"}).model.gguf_in_place is False
    assert EngineConfig.from_env({"CHATSERVE_GGUF_IN_PLACE": "auto"}).model.gguf_in_place is None
    env = EngineConfig.from_env({})
    p = build_parser(env)
    assert [config_from_args(p.parse_args(a), env).model.gguf_in_place
            for a in ([], ["--gguf-in-place"], ["--no-gguf-in-place"])] == [None, True, False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_runs_a_gguf_in_place_where_the_backend_says_so(dtype):
    """auto: the default GGUF's matrices stay in their blocks on a backend that prefers it (cpu-avx2, AVX2-only
    CPUs) under float32, and become dense copies + int4 everywhere else; the flags override either way."""
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.runtime.models.linear_backends import choose_block_backend
    import torch
    backend = choose_block_backend(torch.device("cpu"))
    r = ModelRunner.from_config(offline_config(None, dtype=dtype, num_blocks=8, weight_quant="auto"), progress=False)
    in_place = backend.in_place_by_default and dtype == "float32"
    assert bool(r.block_formats) == in_place, (backend.name, r.block_formats)
    assert r.weight_quant == (None if in_place else "int4")
    forced = ModelRunner.from_config(offline_config(None, dtype=dtype, num_blocks=8, gguf_in_place=True), progress=False)
    assert forced.block_formats == ["Q4_1", "Q8_0"] and forced.weight_quant is None
