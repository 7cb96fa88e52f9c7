"""`--model NAME=PATH` beside a plain `--model PATH` (one argparse path), Ollama's keep_alive durations, and the KV cache
budget split among the models loaded at once (chatserve/server/model_specs.py, config.parse_duration)."""
from __future__ import annotations

import pytest

from chatserve.config import EngineConfig, parse_duration
from chatserve.server.model_specs import check_unique, model_specs, parse_named, parse_spec, split_model_values
from chatserve.server.serve import build_parser, config_from_args


def test_every_model_flag_reaches_argparse_and_one_parser_tells_named_from_plain():
    argv = ["--model", "a=/m/a.gguf", "--port", "9", "--model=b=/m/b", "--model", "/m/plain.gguf"]
    args, named = split_model_values(build_parser().parse_args(argv))
    assert named == [("a", "/m/a.gguf"), ("b", "/m/b")]
    assert args.model == "/m/plain.gguf" and args.port == 9
    cfg = config_from_args(args, EngineConfig())
    assert cfg.model.model == "/m/plain.gguf" and cfg.server.port == 9
    for tag in ("qwen3:4b", "org/repo:Q4_K_M", "/p/with=sign/m.gguf"):   # Ollama tag, hub name, '/' in NAME
        args, named = split_model_values(build_parser().parse_args(["--model", tag]))
        assert named == [] and args.model == tag and parse_spec(tag) is None
    args, named = split_model_values(build_parser().parse_args(["--model", "x=/p/x"]))
    assert named == [("x", "/p/x")] and not hasattr(args, "model")          # no plain one: the default
    assert split_model_values(args) == (args, [])                            # idempotent
    assert config_from_args(build_parser().parse_args(["/m/pos.gguf"]), EngineConfig()).model.model == "/m/pos.gguf"
    with pytest.raises(ValueError, match="name each one"):
        split_model_values(build_parser().parse_args(["--model", "/m/1.gguf", "--model", "/m/2.gguf"]))
    assert parse_named(("x=/p/x.gguf",)) == [("x", "/p/x.gguf")]
    with pytest.raises(ValueError):
        parse_named(("no-equals",))


@pytest.mark.parametrize("text, seconds", [("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), ("0", 0.0),
                                           ("-1", -1.0), ("-1m", -60.0), ("2.5", 2.5), (90, 90.0), (-1, -1.0)])
def test_keep_alive_durations_follow_ollama(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["soon", "5 minutes", "", "m", True])
def test_a_bad_duration_is_refused(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_the_kv_budget_is_split_among_the_models_loaded_at_once():
    base = EngineConfig().replace_section("cache", kv_cache_memory=3 << 30).replace_section(
        "server", max_loaded_models=2)
    specs = model_specs(base, [("a", "/m/a"), ("b", "/m/b"), ("c", "/m/c")])
    assert [s.name for s in specs] == ["a", "b", "c"]                 # no plain --model: a is the default
    assert {s.config.cache.kv_cache_memory for s in specs} == {3 << 29}
    assert [s.config.model.model for s in specs] == ["/m/a", "/m/b", "/m/c"]
    plain = base.replace_section("model", model="/m/p.gguf")
    specs = model_specs(plain, [("a", "/m/a")])
    assert [s.name for s in specs] == ["", "a"] and specs[0].config.model.model == "/m/p.gguf"
    one = model_specs(plain, [])
    assert len(one) == 1 and one[0].config.cache.kv_cache_memory == 3 << 30   # one model keeps it all
    exact = model_specs(base.replace_section("cache", num_blocks=64), [("a", "/m/a"), ("b", "/m/b")])
    assert {s.config.cache.num_blocks for s in exact} == {64}               # --kv-blocks: each gets that many
    with pytest.raises(ValueError, match="'a' is given twice"):
        check_unique(model_specs(base, [("a", "/m/a"), ("a", "/m/b")]))
