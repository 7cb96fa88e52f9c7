"""The models a server is asked to serve: `--model NAME=PATH` (repeatable) beside a plain `--model PATH`,
and the KV cache share a model first loads with (the pool hands out the rest: engine/model_pool.py).

Parsing only: no files are read here (prepare_model checks them) and nothing is loaded. Every `--model`
value reaches argparse (serve.build_parser appends them); `parse_spec` is the one place that tells
NAME=PATH from a plain path.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace

from chatserve.config import EngineConfig, parse_duration

__all__ = ["ModelSpec", "check_unique", "model_specs", "parse_duration", "parse_named", "parse_spec",
           "shared_kv_budget", "split_model_values"]

_SPEC_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._:-]{0,127})=(.+)")   # no '/' in NAME: a path may hold '='


@dataclass(frozen=True)
class ModelSpec:
    """One served model: the name requests use, its own config (model path, KV share), more names."""

    name: str
    config: EngineConfig
    aliases: tuple[str, ...] = ()


def parse_spec(text: str) -> tuple[str, str] | None:
    """NAME=PATH → (NAME, PATH); None for anything else (a plain path, `org/repo:QUANT`, `model:tag`)."""
    m = _SPEC_RE.fullmatch(text.strip())
    return None if m is None else (m.group(1), m.group(2))


def parse_named(texts: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """NAME=PATH strings (CHATSERVE_MODELS, comma-separated) → pairs; ValueError names a bad one."""
    out = []
    for t in texts:
        pair = parse_spec(t)
        if pair is None:
            raise ValueError(f"not NAME=PATH: {t!r}")
        out.append(pair)
    return out


def split_model_values(args: argparse.Namespace) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    """`args` (serve's parser appends every `--model` value) with the plain `--model PATH` as the model
    setting (it keeps its one-model meaning), and the `--model NAME=PATH` pairs in order. ValueError for
    two plain ones (which one would be the default?). Idempotent."""
    values = getattr(args, "model", None)
    if not isinstance(values, list):
        return args, []
    plain = [v for v in values if parse_spec(v) is None]
    if len(plain) > 1:
        raise ValueError(f"--model is given {len(plain)} times without a name ({', '.join(plain)}); "
                         f"name each one: --model NAME=PATH")
    out = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "model"})
    if plain:
        out.model = plain[0]
    return out, parse_named([v for v in values if parse_spec(v) is not None])


def kv_share(cfg: EngineConfig, n_models: int) -> EngineConfig:
    """`cfg` with the KV cache budget split among the models that may be loaded at once: the share the
    first load gets (the pool hands later loads the free budget ÷ the empty slots; model_pool.py), and
    the estimate --model-memory-budget counts before a model is loaded."""
    if n_models <= 1 or cfg.cache.num_blocks is not None:
        return cfg
    return cfg.replace_section("cache", kv_cache_memory=cfg.cache.kv_cache_memory // n_models)


def shared_kv_budget(base: EngineConfig, specs: list[ModelSpec]) -> int:
    """The KV cache bytes the loaded models share (--kv-cache-memory), or 0 when each model sizes its own
    cache: one model, --kv-blocks (each gets that many), or CUDA's --gpu-memory-utilization."""
    cache = base.cache
    if len(specs) < 2 or cache.num_blocks is not None or cache.gpu_memory_utilization is not None:
        return 0
    return int(cache.kv_cache_memory)


def model_specs(base: EngineConfig, named: list[tuple[str, str]]) -> list[ModelSpec]:
    """The served models, each with `base`'s settings and its share of the KV cache budget: the plain
    --model (or the default model) first, unnamed (""; the caller names it from its resolved path), when
    no NAME=PATH was given or --model PATH was given too; then each NAME=PATH. The first is the default
    a request without `model` gets."""
    specs: list[ModelSpec] = []
    if not named or base.model.model is not None:
        specs.append(ModelSpec("", base))
    for name, path in named:
        model = replace(base.model, model=path, served_model_name=name)
        specs.append(ModelSpec(name, replace(base, model=model)))
    loaded_at_once = min(len(specs), max(1, base.server.max_loaded_models))
    return [replace(s, config=kv_share(s.config, loaded_at_once)) for s in specs]


def check_unique(specs: list[ModelSpec]) -> list[ModelSpec]:
    """`specs`, or ValueError naming a name given twice."""
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"the model name {s.name!r} is given twice")
        seen.add(s.name)
    return specs
