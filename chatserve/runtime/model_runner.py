"""ModelRunner: one SchedulerOutput → block copies, input tensors, forward, logits, sampling → RunnerOutput.

Owns the model and its KV cache tensors. Not a scheduler: which tokens run, and where their K/V live,
is decided by the scheduler and the KV cache manager and arrives here as plain lists.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

import chatserve_kernels
from chatserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, TokenLogprob
from chatserve.runtime.device import resolve_device, resolve_dtype, set_num_threads
from chatserve.runtime.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for_budget
from chatserve.runtime.models import build_model
from chatserve.runtime.weights import ArchConfig, LoadedWeights, load_weights, torch_dtype

log = logging.getLogger(__name__)


class _GreedySampler:
    """Stand-in with the Sampler interface, used only when chatserve.runtime.sampler is absent."""

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [B, V] float32
        ids = logits.argmax(-1).tolist()
        return ids, [None] * len(ids)

    def drop(self, request_ids: list[str]) -> None:
        pass


def _make_sampler():
    try:
        from chatserve.runtime.sampler import Sampler
    except ImportError:
        log.warning("chatserve.runtime.sampler not found: sampling greedily")
        return _GreedySampler()
    return Sampler()


def auto_weight_quant(weights: LoadedWeights, device: torch.device) -> str | None:
    """int4 on CPU for a GGUF stored in 4 bits (the default model: Q4_1), where the int4 kernels
    rebuild the stored weights and decode about 2× faster than fp32 at batch 1 (docs/benchmarks.md);
    dense weights otherwise (requantizing 8/16-bit weights costs quality; CUDA has no int4 path here)."""
    return "int4" if device.type == "cpu" and getattr(weights, "four_bit", False) else None


class ModelRunner:
    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_memory: int = 2 << 30,
                 max_model_len: int | None = None, num_threads: int | None = None,
                 progress: bool = True, weights: LoadedWeights | None = None,
                 weight_quant: str | None = None, kv_cache_dtype: str = "auto") -> None:
        """weights: already-loaded weights of model_path (tests and benchmarks reuse one read).
        weight_quant: None, "int8" or "int4" for weight-only quantized decode matmuls (see
        models.llama.Linear), or "auto" (auto_weight_quant: int4 for a 4-bit GGUF on CPU, else None).
        dtype: float32 | bfloat16 | float16, or "auto" (device.resolve_dtype: bf16 where the hardware has it).
        kv_cache_dtype: "auto" (= dtype), or a quantized cache: "int8", "fp8", "fp8_per_tensor"."""
        t0 = time.perf_counter()
        self.device = resolve_device(device)
        # CPU threads per step: all (or num_threads) for steps of many tokens (prefill: compute-bound,
        # a second thread pays); for small steps (decode of <= SMALL_STEP_TOKENS) one core is left to
        # the event loop, HTTP and detokenizer when num_threads is auto: there the GEMVs are
        # memory-bound and the OpenMP barrier stalls whenever another thread takes a core (measured
        # on 2 cores, one stream: TPOT 45.7 ms with 2 threads, 32.3 ms with 1; 16 streams: 64.2 vs
        # 57.0 output tok/s, so big steps keep both).
        self._threads_big = self._threads_small = None
        if self.device.type == "cpu":
            self._threads_big = set_num_threads(num_threads)
            self._threads_small = self._threads_big if num_threads else max(1, self._threads_big - 1)
        self.dtype = torch_dtype(resolve_dtype(dtype, self.device) if isinstance(dtype, str) else dtype)
        self.model_path = model_path
        if weights is None:
            weights = load_weights(model_path, self.dtype, progress=progress)
        self.config: ArchConfig = weights.config
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        if weight_quant == "auto":
            weight_quant = auto_weight_quant(weights, self.device)
        self.weight_quant = weight_quant
        self.model = build_model(self.config, weights.tensors, self.dtype, self.device, self.max_model_len,
                                 weight_quant=weight_quant)
        del weights
        self.block_size = int(block_size)
        self.kv_cache_dtype = kv_cache_dtype
        self.num_blocks = int(num_blocks) if num_blocks is not None else num_blocks_for_budget(
            self.config, self.block_size, self.dtype, kv_cache_memory, kv_cache_dtype)
        self.kv_caches = allocate_kv_caches(self.config, self.block_size, self.dtype, self.device,
                                            num_blocks=self.num_blocks, kv_cache_dtype=kv_cache_dtype)
        self.bytes_per_block = bytes_per_block(self.config, self.block_size, self.dtype, kv_cache_dtype)
        self.sampler = _make_sampler()
        self.load_seconds = time.perf_counter() - t0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # ---------------------------------------------------------------------------------------
    SMALL_STEP_TOKENS = 8

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        res = RunnerOutput(step_id=out.step_id)
        if self._threads_big is not None and self._threads_small != self._threads_big:
            small = sum(len(s.token_ids) for s in out.seqs) <= self.SMALL_STEP_TOKENS
            n = self._threads_small if small else self._threads_big
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
        if out.finished_ids:
            self.sampler.drop(list(out.finished_ids))
        with torch.inference_mode():
            if out.copy_ops:
                self._copy_blocks([(op.src, op.dst) for op in out.copy_ops])
            seqs = []
            for s in out.seqs:
                err = self._check(s)
                if err is None:
                    seqs.append(s)
                else:
                    res.errors[s.request_id] = err
            if not seqs:
                return res
            hidden = self._forward_isolating_errors(seqs, res.errors)    # request_id → [H]
            sampled = [s for s in seqs if s.sample and s.request_id in hidden]
            if sampled:
                h = torch.stack([hidden[s.request_id] for s in sampled])  # [B, H]
                logits = self.model.compute_logits(h)                    # [B, V] float32
                self._sample(logits, sampled, res)
        return res

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device).view(-1, 2)  # [M, 2]
        caches = self.kv_caches
        kw = {}
        if len(caches[0]) == 4:
            kw = {"k_scales": [c[2] for c in caches], "v_scales": [c[3] for c in caches]}
        chatserve_kernels.copy_blocks([c[0] for c in caches], [c[1] for c in caches], mapping, **kw)

    def _check(self, s: ScheduledSeq) -> str | None:
        n = len(s.token_ids)
        if n == 0:
            return "no tokens scheduled"
        if s.start_pos < 0 or s.seq_len > self.max_model_len:
            return f"positions {s.start_pos}..{s.seq_len} exceed the context length {self.max_model_len}"
        if len(s.block_table) * self.block_size < s.seq_len:
            return f"block table of {len(s.block_table)} blocks cannot hold {s.seq_len} tokens"
        if any(b < 0 or b >= self.num_blocks for b in s.block_table):
            return "block table holds an out-of-range block id"
        v = self.config.vocab_size
        if any(t < 0 or t >= v for t in s.token_ids):
            return f"token id outside the vocabulary [0, {v})"
        return None

    def _forward_isolating_errors(self, seqs: list[ScheduledSeq], errors: dict[str, str]
                                  ) -> dict[str, torch.Tensor]:
        """Forward the batch; if it fails, rerun each sequence alone so one bad request ends alone."""
        try:
            return self._forward(seqs)
        except Exception as e:  # noqa: BLE001 — isolate below
            if len(seqs) == 1:
                log.exception("forward failed for %s", seqs[0].request_id)
                errors[seqs[0].request_id] = f"forward failed: {e}"
                return {}
            log.exception("batched forward failed; retrying %d sequences one by one", len(seqs))
        hidden: dict[str, torch.Tensor] = {}
        for s in seqs:
            try:
                hidden.update(self._forward([s]))
            except Exception as e:  # noqa: BLE001
                errors[s.request_id] = f"forward failed: {e}"
        return hidden

    def _forward(self, seqs: list[ScheduledSeq]) -> dict[str, torch.Tensor]:
        """Run one flattened batch; return the last-token hidden state of every sampling sequence."""
        ids: list[int] = []
        pos: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.seq_len))
        dev = self.device
        meta = chatserve_kernels.AttentionMetadata.build(
            [s.num_tokens for s in seqs], [s.seq_len for s in seqs], [s.block_table for s in seqs],
            self.block_size, dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)      # [T]
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)      # [T]
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)  # [T, H]
        out: dict[str, torch.Tensor] = {}
        end = 0
        for s in seqs:
            end += s.num_tokens
            if s.sample:
                out[s.request_id] = hidden[end - 1]
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq], res: RunnerOutput) -> None:
        try:
            self._apply_sampler(self.sampler, logits, seqs, res)
            return
        except Exception:  # noqa: BLE001 — isolate the failing row below
            log.exception("batched sampling failed; sampling rows one by one")
        for i, s in enumerate(seqs):
            try:
                self._apply_sampler(self.sampler, logits[i:i + 1], [s], res)
            except Exception as e:  # noqa: BLE001
                res.errors[s.request_id] = f"sampling failed: {e}"

    @staticmethod
    def _apply_sampler(sampler: Callable, logits: torch.Tensor, seqs: list[ScheduledSeq],
                       res: RunnerOutput) -> None:
        ids, lps = sampler(logits, seqs)
        for s, tok, lp in zip(seqs, ids, lps):
            res.sampled[s.request_id] = int(tok)
            if lp is not None:
                res.logprobs[s.request_id] = lp
