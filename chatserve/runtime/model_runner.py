"""ModelRunner: one SchedulerOutput → block copies, input tensors, forward, logits, sampling → RunnerOutput.

Owns the model and its KV cache tensors. Not a scheduler: which tokens run, and where their K/V live,
is decided by the scheduler and the KV cache manager and arrives here as plain lists.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

import chatserve_kernels
from chatserve_kernels import cpu_build
from chatserve_kernels.triton_warm_up import warm_up_attention
from chatserve.config import CacheConfig, EngineConfig, ModelConfig
from chatserve.core.ngram_proposer import can_draft
from chatserve.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput, TokenLogprob
from chatserve.core.request import SamplingParams
from chatserve.runtime.device import resolve_device, resolve_dtype, set_num_threads
from chatserve.runtime.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for_budget
from chatserve.runtime.models import build_model
from chatserve.runtime.models.layers import RowSplit
from chatserve.runtime.models.linear_backends import BlockMatrix, choose_block_backend
from chatserve.runtime.sampler import Sampler
from chatserve.runtime.arch_config import ArchConfig
from chatserve.runtime.weights import LoadedWeights, load_weights, torch_dtype

log = logging.getLogger(__name__)


def auto_weight_quant(weights: LoadedWeights, device: torch.device) -> str | None:
    """int4 on CPU for a GGUF stored in 4 bits (the default model: Q4_1), where the int4 kernels
    rebuild the stored weights and decode faster than fp32 at batch 1 (docs/benchmarks.md);
    dense weights otherwise (requantizing 8/16-bit weights costs quality; CUDA has no int4 path here)."""
    return "int4" if device.type == "cpu" and weights.four_bit else None


def gpu_kv_budget(free_bytes: int, total_bytes: int, utilization: float) -> int:
    """KV cache bytes under --gpu-memory-utilization: the share of the device this process may use,
    less what is already taken (weights, other processes), measured after the weights are loaded."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(free_bytes - total_bytes * (1.0 - utilization))
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization}: nothing left for the KV cache "
                         f"({free_bytes / 2**30:.1f} GiB free of {total_bytes / 2**30:.1f} GiB)")
    return budget


WARM_UP_ID = "__warm_up__"
# without batch invariance, prompt chunks of at least this many rows take torch's flash kernel, on CPUs with
# AMX only: there it does a 4,000-token layer 5x faster than the C kernel; on AVX-512 BF16 without AMX (Zen 5)
# it is 1.8-2.8x slower in bf16 and no faster in float32 (docs/benchmarks.md, "Zen 5, quiet"). Not tuned:
# measured only on 4,000-token prompts; short chunks stay on the C kernel, which also runs their decode rows
FLASH_PROMPT_ROWS = 256


def flash_prompt_rows(cpu_flags: set[str]) -> int:
    """The flash route's threshold for a CPU with these /proc/cpuinfo flags: FLASH_PROMPT_ROWS with AMX, else 0
    (off)."""
    return FLASH_PROMPT_ROWS if "amx_bf16" in cpu_flags else 0


class ModelRunner:
    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = False,
                    weights: LoadedWeights | None = None) -> "ModelRunner":
        """The runner of `config` (the builder's, and scripts' and tests' through
        chatserve.config.offline_config(path, dtype=…, num_blocks=…)); max_model_len from its scheduler."""
        return cls(config.model, config.cache, max_model_len=config.scheduler.max_model_len,
                   progress=progress, weights=weights)

    def __init__(self, model: ModelConfig, cache: CacheConfig, *, max_model_len: int | None = None,
                 progress: bool = True, weights: LoadedWeights | None = None) -> None:
        """model, cache: the model and KV cache sections of the config (chatserve/config.py); every
        setting comes from them (no defaults of the runner's own). weights: already-loaded weights of
        the model (tests and benchmarks reuse one read)."""
        t0 = time.perf_counter()
        self.device = resolve_device(model.device)
        self._threads_big: int | None = None       # CPU threads for big steps, for small ones
        self._threads_small: int | None = None
        if self.device.type == "cpu":
            self._set_step_threads(model.num_threads)
        if model.seed is not None:
            torch.manual_seed(model.seed)
        self.dtype = torch_dtype(resolve_dtype(model.dtype, self.device))
        self.model_path = model.resolved_model()
        self.block_backend = choose_block_backend(self.device, model.cpu_isa)   # once, for the model's life
        in_place = self.device.type == "cpu" and (
            model.gguf_in_place if model.gguf_in_place is not None
            else self.block_backend.in_place_by_default and self.dtype == torch.float32
            and model.weight_quant == "auto")
        if weights is None:
            weights = load_weights(self.model_path, self.dtype, progress=progress, in_place=in_place)
        self.config: ArchConfig = weights.config
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        weight_quant = model.weight_quant
        if weight_quant == "auto":
            weight_quant = None if in_place and weights.source == "gguf" else auto_weight_quant(weights, self.device)
        self.weight_quant = weight_quant
        self.batch_invariant = model.batch_invariant     # RowSplit per step, else rows by step size
        if weight_quant and progress:
            log.info("repacking the weights as %s for the decode matmuls", weight_quant)
        self.model = build_model(self.config, weights.tensors, self.dtype, self.device, self.max_model_len,
                                 weight_quant=weight_quant, block_backend=self.block_backend)
        if not self.batch_invariant and hasattr(self.model, "flash_rows"):    # long prompt chunks through
            self.model.flash_rows = flash_prompt_rows(cpu_build.cpu_flags())   # torch's flash kernel (AMX)
        if weights.tiled_store is not None:       # every tiled run is in: publish the cache file
            weights.tiled_store.finish()
        weights.release_pages()                   # in place: the GGUF pages read while loading leave the RSS
        self.block_formats = sorted({f for t in weights.tensors.values() if isinstance(t, BlockMatrix)
                                     for f in t.formats()})
        if self.block_formats and progress:
            log.info("backend: %s for the %s matrices, in place", self.block_backend.name,
                     "/".join(self.block_formats))
        if not model.num_threads and (self.model.chain is not None
                                      or self.model.decode_matmul_bytes() >= self.BIG_MATMUL_BYTES):
            self._threads_small = self._threads_big
        del weights
        self.block_size = int(cache.block_size)
        self.kv_cache_dtype = cache.kv_cache_dtype
        self.num_blocks = self._num_blocks(cache)
        self.kv_caches = allocate_kv_caches(self.config, self.block_size, self.dtype, self.device,
                                            num_blocks=self.num_blocks, kv_cache_dtype=self.kv_cache_dtype)
        self.bytes_per_block = bytes_per_block(self.config, self.block_size, self.dtype, self.kv_cache_dtype)
        self.sampler = Sampler()
        self._prompt_rows: dict[str, torch.Tensor] = {}   # this step's prompt-logprobs hidden rows
        self.load_seconds = time.perf_counter() - t0

    # A decode matmul reading this many weight bytes or more runs long enough that a second core's memory
    # bandwidth outweighs the OpenMP barrier stalls the event loop causes (docs/benchmarks.md).
    BIG_MATMUL_BYTES = 8 << 20

    def _set_step_threads(self, num_threads: int | None) -> None:
        """CPU threads per step: all (or num_threads) for steps of many tokens (compute-bound prefill);
        with num_threads auto, one core fewer for small (decode) steps run by torch ops, which stall on
        the OpenMP barrier whenever the event loop takes a core. A model with the C decode chain, or whose
        decode matmuls are big (BIG_MATMUL_BYTES), keeps every core for them: the chain's steps are a few
        dozen kernels, and a big matmul's time dwarfs a stall, so both gain from the second core's memory
        bandwidth far more than they lose to the event loop (docs/benchmarks.md)."""
        big = set_num_threads(num_threads)
        self._threads_big = big
        self._threads_small = big if num_threads else max(1, big - 1)

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return int(cache.num_blocks)
        budget = cache.kv_cache_memory
        if cache.gpu_memory_utilization is not None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = gpu_kv_budget(free, total, cache.gpu_memory_utilization)
        return num_blocks_for_budget(self.config, self.block_size, self.dtype, budget, cache.kv_cache_dtype)

    def warm_up(self) -> float:
        """One dummy prefill and one decode step over KV blocks no request owns yet, so kernels
        compile (C at first use, Triton on CUDA) before the first user request; on the Triton backend
        also every split and tile variant of the attention kernels (triton_warm_up); seconds taken."""
        t0 = time.perf_counter()
        prompt_len = max(1, min(self.block_size, self.max_model_len - 1))
        blocks_needed = -(-(prompt_len + 1) // self.block_size)
        if blocks_needed > self.num_blocks:
            return 0.0                            # a cache too small to warm up in: skip it
        table = list(range(blocks_needed))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        steps = (([0] * prompt_len, 0), ([0], prompt_len))        # (token ids, start position)
        for step_id, (ids, start) in enumerate(steps):
            seq = ScheduledSeq(request_id=WARM_UP_ID, token_ids=ids, start_pos=start,
                               block_table=table, sample=True, params=params,
                               prompt_token_ids=[0] * prompt_len)          # prompt rows: the dense path
            out = self.execute(SchedulerOutput(step_id=step_id, seqs=[seq]))
            if out.errors:
                raise RuntimeError(f"warm-up step failed: {out.errors[WARM_UP_ID]}")
        self.sampler.drop([WARM_UP_ID])
        if getattr(getattr(self.model, "attention_backend", None), "name", None) == "triton":
            c = self.config                       # the split and narrow-tile variants, before any request
            warm_up_attention(self.kv_caches[0], c.num_heads, self.dtype,
                              {c.layer_window(i) for i in range(c.num_layers)})
        return time.perf_counter() - t0

    @property
    def kv_window(self) -> int | None:
        return self.config.kv_window

    @property
    def model_key(self) -> str:
        return f"{self.model_path}:{self.dtype}"

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    # ---------------------------------------------------------------------------------------
    SMALL_STEP_TOKENS = 8

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step; the result carries its wall time (the scheduler sizes prompt chunks by it)."""
        t0 = time.perf_counter()
        res = self._execute(out)
        res.elapsed_s = time.perf_counter() - t0
        return res

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        res = RunnerOutput(step_id=out.step_id)
        big, few = self._threads_big, self._threads_small
        if big is not None and few is not None and few != big:
            small = sum(len(s.token_ids) for s in out.seqs) <= self.SMALL_STEP_TOKENS
            n = few if small else big
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
            self.sampler.prefetch_masks([s for s in seqs if s.sample], self.config.vocab_size)
            hidden = self._forward_isolating_errors(seqs, res.errors)    # request_id → [H] ([k+1, H] drafted)
            if self._prompt_rows:
                self._prompt_logprobs(seqs, res)
            sampled = [s for s in seqs if s.sample and s.request_id in hidden]
            drafted = [s for s in sampled if s.draft_token_ids]
            if drafted:
                self._verify(hidden, drafted, res)
                sampled = [s for s in sampled if not s.draft_token_ids]
            if sampled:
                h = torch.stack([hidden[s.request_id] for s in sampled])  # [B, H]
                logits = self.model.compute_logits(h)                    # [B, V] float32
                self._sample(logits, sampled, res)
        return res

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device).view(-1, 2)  # [M, 2]
        caches = self.kv_caches
        scaled = len(caches[0]) == 4
        k_scales: list[torch.Tensor | None] | None = [c[2] for c in caches] if scaled else None
        v_scales: list[torch.Tensor | None] | None = [c[3] for c in caches] if scaled else None
        chatserve_kernels.copy_blocks([c[0] for c in caches], [c[1] for c in caches], mapping, k_scales, v_scales)

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
        if s.draft_token_ids and not can_draft(s.params, len(s.output_token_ids)):
            # the contract: the scheduler drafts only rows whose next token is the plain argmax
            return "drafts for a row that the argmax cannot verify (its sampling does not allow drafts)"
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
        generated: list[bool] = []          # a row past its prompt: a generated token (RowSplit)
        for s in seqs:
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.seq_len))
            plen = len(s.prompt_token_ids)
            generated.extend(p >= plen for p in range(s.start_pos, s.seq_len))
        dev = self.device
        meta = chatserve_kernels.AttentionMetadata.build(
            [s.num_tokens for s in seqs], [s.seq_len for s in seqs], [s.block_table for s in seqs],
            self.block_size, dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)      # [T]
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)      # [T]
        rows = RowSplit.build(generated, dev) if self.batch_invariant else None
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta, rows)  # [T, H]
        out: dict[str, torch.Tensor] = {}
        end = 0
        for s in seqs:
            end += s.num_tokens
            if s.sample:
                k = len(s.draft_token_ids)
                out[s.request_id] = hidden[end - 1 - k:end] if k else hidden[end - 1]
            if s.params.prompt_logprobs is not None:
                self._keep_prompt_rows(s, hidden[end - s.num_tokens:end])
        return out

    # ── prompt logprobs (params.prompt_logprobs): only the sequences that ask pay for them ──────────
    PROMPT_LOGPROB_ROWS = 256        # logits rows per log_softmax, bounding memory to rows × vocab floats

    def _keep_prompt_rows(self, s: ScheduledSeq, rows: torch.Tensor) -> None:
        """Keep the hidden rows of this chunk's positions p that have a next prompt token (p + 1 < len)."""
        # rows: [num_tokens, H]
        m = min(s.seq_len, len(s.prompt_token_ids) - 1) - s.start_pos
        if m > 0:
            self._prompt_rows[s.request_id] = rows[:m]

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], res: RunnerOutput) -> None:
        """log_softmax of the raw logits at each kept position → the next prompt token's logprob,
        vocabulary rank and top-k, into res.prompt_logprobs."""
        rows, self._prompt_rows = self._prompt_rows, {}
        for s in seqs:
            h = rows.get(s.request_id)
            if h is None or s.request_id in res.errors:
                continue
            k = min(int(s.params.prompt_logprobs or 0), self.vocab_size)
            start = s.start_pos + 1
            targets = torch.tensor(s.prompt_token_ids[start:start + h.shape[0]], device=h.device)  # [m]
            out: list[TokenLogprob] = []
            for a in range(0, h.shape[0], self.PROMPT_LOGPROB_ROWS):
                lp = torch.log_softmax(self.model.compute_logits(h[a:a + self.PROMPT_LOGPROB_ROWS]).float(), -1)
                tgt = targets[a:a + lp.shape[0]]                                       # [r]
                chosen = lp.gather(1, tgt.unsqueeze(1))                                # [r, 1]
                ranks = ((lp > chosen).sum(-1) + 1).tolist()
                tv, ti = [], []
                if k:
                    top_v, top_i = lp.topk(k, dim=-1)                                  # [r, k]
                    tv, ti = top_v.tolist(), top_i.tolist()
                for r, (t, v) in enumerate(zip(tgt.tolist(), chosen.squeeze(1).tolist())):
                    top = list(zip(ti[r], tv[r])) if k else []
                    out.append(TokenLogprob(token_id=t, logprob=v, top=top, rank=ranks[r]))
            res.prompt_logprobs[s.request_id] = out

    def _verify(self, hidden: dict[str, torch.Tensor], seqs: list[ScheduledSeq], res: RunnerOutput) -> None:
        """Speculative decoding: the model's greedy token at every position of each drafted sequence;
        its drafts are accepted up to the first disagreement, and the model's token there (the bonus
        token when all agree) ends the run. Every row here passed `_check`, so can_draft holds for it
        and the plain argmax is exactly what the sampler would choose."""
        rows = torch.cat([hidden[s.request_id] for s in seqs])         # [R, H], R = Σ (k_i + 1)
        best = self.model.compute_logits(rows).argmax(dim=-1).tolist()  # [R]
        at = 0
        for s in seqs:
            drafts = s.draft_token_ids
            j = 0
            while j < len(drafts) and best[at + j] == drafts[j]:
                j += 1
            res.accepted[s.request_id] = drafts[:j] + [best[at + j]]
            res.sampled[s.request_id] = best[at + j]
            at += len(drafts) + 1

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
    def _apply_sampler(sampler: Callable[..., Any], logits: torch.Tensor, seqs: list[ScheduledSeq],
                       res: RunnerOutput) -> None:
        ids, lps = sampler(logits, seqs)
        for s, tok, lp in zip(seqs, ids, lps):
            res.sampled[s.request_id] = int(tok)
            if lp is not None:
                res.logprobs[s.request_id] = lp

