"""chatserve/config.py: one declaration → flags, CHATSERVE_* variables and dataclasses, parsed alike."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from chatserve.config import (KV_CACHE_DTYPES, SECTIONS, ConfigError, EngineConfig, add_arguments,
                              config_from_args, settings)


def parse(argv: list[str], environ: dict[str, str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv), EngineConfig.from_env(environ or {}))


def test_every_field_is_declared_once_with_a_flag_or_a_variable():
    flags: set[str] = set()
    for section, cls in SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        declared = [s.name for s in settings(section)]
        assert declared == names                       # no field without its declaration
    for s in settings():
        assert s.option.help
        for name in (s.flag, *s.option.aliases):
            assert name not in flags, name
            flags.add(name)
    assert EngineConfig.from_env({}) == EngineConfig()


def test_kv_cache_dtype_choices_are_the_kernels():
    import chatserve_kernels as kernels
    assert tuple(KV_CACHE_DTYPES) == tuple(kernels.KV_CACHE_DTYPES)


def test_env_values_parse_as_strictly_as_flags():
    env = {"CHATSERVE_KV_CACHE_MEMORY": "2GiB", "CHATSERVE_MAX_BODY_BYTES": "512KiB",
           "CHATSERVE_ENABLE_PREFIX_CACHING": "false", "CHATSERVE_PORT": "9001",
           "CHATSERVE_WATERMARK": "0.05", "CHATSERVE_MAX_MODEL_LEN": "none", "CHATSERVE_WEIGHT_QUANT": "none"}
    cfg = EngineConfig.from_env(env)
    assert cfg.cache.kv_cache_memory == 2 << 30 and cfg.server.max_body_bytes == 512 << 10
    assert cfg.cache.enable_prefix_caching is False and cfg.server.port == 9001
    assert cfg.cache.watermark == 0.05 and cfg.scheduler.max_model_len is None
    assert cfg.model.weight_quant is None
    for var, value, words in (("CHATSERVE_PORT", "abc", "not an integer"),
                              ("CHATSERVE_ENABLE_PREFIX_CACHING", "flase", "not a boolean"),
                              ("CHATSERVE_KV_CACHE_MEMORY", "lots", "not a size"),
                              ("CHATSERVE_KV_CACHE_DTYPE", "fp4", "invalid choice"),
                              ("CHATSERVE_BLOCK_SIZE", "12", "invalid choice")):
        with pytest.raises(ConfigError) as e:
            EngineConfig.from_env({var: value})
        assert str(e.value).startswith(f"{var}: ") and words in str(e.value) and "\n" not in str(e.value)


def test_flags_vllm_names_old_aliases_and_precedence():
    env = {"CHATSERVE_MAX_NUM_SEQS": "7", "CHATSERVE_API_KEY": "k1,k2", "CHATSERVE_BLOCK_SIZE": "32"}
    cfg = parse(["some/model.gguf", "--num-gpu-blocks-override", "48", "--max-num-seqs", "16",
                 "--no-enable-prefix-caching", "--allowed-origins", "https://a", "--cors-origin", "https://b",
                 "--kv-cache-memory", "1GiB", "--seed", "3", "--max-tokens-default", "200"], env)
    assert cfg.model.model == "some/model.gguf" and cfg.model.seed == 3
    assert cfg.cache.num_blocks == 48 and cfg.cache.kv_cache_memory == 1 << 30
    assert cfg.cache.block_size == 32                                # from the environment
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.scheduler.max_num_seqs == 16                          # the flag wins
    assert cfg.server.cors_origins == ("https://a", "https://b")
    assert cfg.server.api_keys == ("k1", "k2") and cfg.server.max_tokens_default == 200
    old = parse(["--model", "m", "--kv-blocks", "9", "--no-prefix-caching", "--api-key", "z"], env)
    assert old.model.model == "m" and old.cache.num_blocks == 9 and not old.cache.enable_prefix_caching
    assert old.server.api_keys == ("z",)
    assert parse(["--enable-prefix-caching"], {"CHATSERVE_ENABLE_PREFIX_CACHING": "0"}).cache.enable_prefix_caching
    with pytest.raises(ConfigError):
        parse(["a.gguf", "--model", "b.gguf"])


def test_bad_flag_values_are_argparse_errors(capsys):
    for argv in (["--port", "abc"], ["--kv-cache-memory", "lots"], ["--kv-cache-dtype", "fp4"]):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
    assert "not a size" in capsys.readouterr().err


def test_generation_config_defaults_and_the_effective_max_tokens(tmp_path):
    from chatserve.config import ModelConfig, ServerConfig
    from chatserve.generation_defaults import load_generation_defaults
    from chatserve.server.served_model import ServedModel
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 512, "do_sample": true}')
    shipped = load_generation_defaults(ModelConfig(model=str(tmp_path)))        # auto: the model's folder
    assert shipped == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 512}
    assert load_generation_defaults(ModelConfig(model=str(tmp_path), generation_config="none")) == {}
    assert load_generation_defaults(ModelConfig(model="x.gguf", generation_config=str(tmp_path))) == shipped
    with pytest.raises(FileNotFoundError):
        load_generation_defaults(ModelConfig(model="x.gguf", generation_config=str(tmp_path / "nope")))

    def state(flag: int | None, defaults: dict) -> ServedModel:
        cfg = EngineConfig(server=ServerConfig(max_tokens_default=flag))
        return ServedModel(name="m", config=cfg, engine=None, tokenizer=None, prompt_guard=None,  # type: ignore[arg-type]  # no engine: only the config is read
                           sampling_defaults=defaults)
    assert state(None, {}).default_max_tokens is None                            # OpenAI: the rest of the context
    assert state(None, shipped).default_max_tokens == 512
    assert state(64, shipped).default_max_tokens == 64
    assert state(64, shipped).default_max_tokens_source == "--max-tokens-default"


def test_process_env_declared_in_config_is_what_the_kernels_read(monkeypatch, tmp_path):
    """kernels/ reads its switches itself (it imports nothing of chatserve): same names, same cache root."""
    from chatserve.config import PROCESS_ENV, cache_root
    from chatserve_kernels import env
    from chatserve.config import FOREIGN_ENV
    assert set(env.NAMES) == set(PROCESS_ENV) and set(env.FOREIGN) <= set(FOREIGN_ENV)
    for environ in ({"CHATSERVE_CACHE_DIR": str(tmp_path / "a")}, {"XDG_CACHE_HOME": str(tmp_path / "x")}, {}):
        monkeypatch.delenv("CHATSERVE_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for k, v in environ.items():
            monkeypatch.setenv(k, v)
        assert cache_root() == env.cache_root()
        assert str(cache_root()).endswith("a" if "CHATSERVE_CACHE_DIR" in environ else "chatserve")


def _env_reads(path) -> set[str]:
    """The variable names a module reads from the environment: os.environ.get/[...]/setdefault/pop,
    os.getenv and `in os.environ`, the name a string literal or a module-level (or kernels/env.py)
    constant. A name it cannot resolve comes back as '?<expression>' so the test below fails on it."""
    import ast
    tree = ast.parse(path.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str) for t in n.targets
              if isinstance(t, ast.Name)}
    from chatserve_kernels import env as kenv
    consts.update({k: v for k, v in vars(kenv).items() if k.isupper() and isinstance(v, str)})

    def name(node) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in consts:
            return consts[node.id]
        if isinstance(node, ast.Attribute) and node.attr in consts:
            return consts[node.attr]
        return "?" + ast.unparse(node)

    def is_environ(node) -> bool:
        return ast.unparse(node) in ("os.environ", "environ")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault", "pop") and is_environ(f.value)) \
                    or ast.unparse(f) in ("os.getenv", "getenv"):
                found.add(name(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            found.add(name(node.slice))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.add(name(node.left))
    return found


def test_every_environment_variable_the_code_reads_is_declared_in_config():
    """Issue 29: grep-proof — every variable chatserve/ and kernels/ read is declared in chatserve/config.py
    (a setting's CHATSERVE_<FIELD>, PROCESS_ENV, CLIENT_ENV or FOREIGN_ENV), with its meaning."""
    from pathlib import Path

    from chatserve.config import declared_env_names
    root = Path(__file__).resolve().parents[1]
    read = {}
    for path in [*root.glob("chatserve/**/*.py"), *root.glob("kernels/*.py")]:
        for var in _env_reads(path):
            read.setdefault(var, []).append(str(path.relative_to(root)))
    assert {"CHATSERVE_URL", "CHATSERVE_CACHE_DIR", "CHATSERVE_FORCE_TRITON", "TRITON_INTERPRET"} <= set(read)
    undeclared = {v: where for v, where in read.items() if v not in declared_env_names()}
    assert not undeclared, undeclared
