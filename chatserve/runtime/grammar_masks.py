"""Per-request grammar matchers and the one batched token bitmask a sampling step applies to its rows.

Lives beside the sampler (runtime side, torch): a request's matcher is created from its compiled spec
on first use, caught up with the tokens it already has (a resumed preempted request, a restart), fed
each sampled token, and dropped when the request ends. Masks are computed ahead on a helper thread,
between steps and during the forward. Not compilation (compiler.py).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, cast

import llguidance
import numpy as np
import torch

from chatserve.core.outputs import ScheduledSeq
from chatserve.runtime.device import available_cores


class _Spec(Protocol):
    """What this module reads of a row's `params.structured` (chatserve.structured.spec.StructuredSpec,
    which core types as `object` because it lives above core and runtime)."""
    @property
    def think(self) -> tuple[int | None, int] | None: ...
    @property
    def compiled(self) -> Any: ...


def _spec(s: ScheduledSeq) -> _Spec:
    return cast(_Spec, s.params.structured)

log = logging.getLogger(__name__)


def _row_key(s: ScheduledSeq) -> tuple[str, int]:
    """A prefetched mask serves a row only at the same request and output length it was computed for."""
    return s.request_id, len(s.output_token_ids)


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    consumed: int = 0          # output tokens fed to the matcher
    begin: int = 0             # the output index the grammar starts at (after a think block)


class GrammarMasks:
    """Matchers by request id; fills one int32 bitmask [R, ceil(V/32)] for the R constrained rows.

    The mask of step N depends only on tokens accepted before step N, so it is computed ahead on a
    helper thread (llguidance releases the GIL while it fills): right after step N-1 accepts its
    tokens (`accept`), while the engine hands the tokens out and schedules step N and the forward's
    threads are idle, and, for rows that had none ahead, during step N's forward (`prefetch`) when
    the step leaves a core idle (fewer torch threads than cores: decode steps on CPU, see
    ModelRunner._set_step_threads; otherwise a helper thread would take a core from the forward's
    OpenMP team). Rows without a mask computed ahead are filled on the step thread just before the
    mask is applied (docs/benchmarks.md).
    """

    overlap: bool | None = None   # None: as above; True: the helper always; False: never (tests, benchmarks)

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}
        self._helper: ThreadPoolExecutor | None = None
        self._pending: tuple[list[tuple[str, int]], Future[Any]] | None = None   # rows, their bitmask
        self._buffer: np.ndarray | None = None    # the additive mask of the last CPU step, reused
        self._think_ends: dict[str, tuple[int, int | None]] = {}   # request → (scanned, grammar start)

    def drop(self, request_ids: Sequence[str]) -> None:
        if self._pending is not None:     # the helper may be creating states; its bitmask stays usable
            wait([self._pending[1]])
        for rid in request_ids:
            self._states.pop(rid, None)
            self._think_ends.pop(rid, None)

    # ── reasoning first: the grammar starts after the end-of-thinking token (StructuredSpec.think) ──
    def begin(self, s: ScheduledSeq) -> int | None:
        """The output index the row's grammar starts at, or None while its think block is open."""
        think = _spec(s).think
        if think is None:
            return 0
        start, end = think
        out = s.output_token_ids
        if start is not None and (not out or out[0] != start):
            return 0                      # the model did not open a block: constrained from the start
        scanned, found = self._think_ends.get(s.request_id, (0, None))
        if found is None and scanned < len(out):
            for k in range(scanned, len(out)):
                if out[k] == end:
                    found = k + 1
                    break
            self._think_ends[s.request_id] = (len(out), found)
        return found

    def active_rows(self, seqs: Sequence[ScheduledSeq], rows: list[int]) -> list[int]:
        """The constrained rows whose grammar applies at this step (not inside a think block)."""
        return [i for i in rows if self.begin(seqs[i]) is not None]

    @staticmethod
    def _may_open(s: ScheduledSeq) -> int | None:
        """The start-of-thinking token a row may still open its output with (its first token), else None."""
        think = _spec(s).think
        return think[0] if think is not None and not s.output_token_ids else None

    def prefetch(self, seqs: Sequence[ScheduledSeq], vocab_size: int) -> None:
        """Before the forward: start the bitmask of these constrained rows on the helper thread, unless
        the one computed after the last step already covers them."""
        want = [_row_key(s) for s in seqs]
        if self._pending is not None and set(want) <= set(self._pending[0]):
            return
        overlap = self.overlap if self.overlap is not None else torch.get_num_threads() < available_cores()
        if overlap and seqs:
            self._settle()
            seqs = list(seqs)
            self._pending = (want, self._submit(self._row_masks, seqs, vocab_size))

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._helper.submit(fn, *args)

    def _settle(self) -> tuple[list[tuple[str, int]], torch.Tensor] | None:
        """Wait for the prefetched mask (the helper must be done with the matchers before anyone else)."""
        if self._pending is None:
            return None
        ids, fut = self._pending
        self._pending = None
        try:
            return ids, fut.result()
        except Exception:  # noqa: BLE001 — recomputed on the step thread, where the error is reported
            return None

    def apply(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place, for `rows` of the batch."""
        # logits: [B, V] float32; rows: indices of constrained rows
        bitmask = self._bitmask([seqs[i] for i in rows], logits.shape[1], self._settle())
        for r, i in enumerate(rows):
            tid = self._may_open(seqs[i])
            if tid is not None:                    # a think block may open the output: allow its tag
                word = int(bitmask[r, tid // 32]) & 0xFFFFFFFF | (1 << (tid % 32))
                bitmask[r, tid // 32] = word - (1 << 32) if word >= 1 << 31 else word
        if logits.device.type == "cpu":
            self._buffer = add_bitmask(logits, rows, bitmask, self._buffer)
        else:
            fill_bitmask(logits, rows, bitmask)

    def _bitmask(self, seqs: list[ScheduledSeq], vocab_size: int,
                 done: tuple[list[tuple[str, int]], torch.Tensor] | None) -> torch.Tensor:
        """The rows' bitmask: the rows computed ahead (`done`) taken from there, the others filled now."""
        want = [_row_key(s) for s in seqs]
        if done is None:
            return self._row_masks(seqs, vocab_size)
        keys, ahead = done
        if want == keys:
            return ahead
        pos = {key: k for k, key in enumerate(keys)}
        have = [r for r, key in enumerate(want) if key in pos]
        if not have:
            return self._row_masks(seqs, vocab_size)
        out = torch.empty(len(want), ahead.shape[1], dtype=torch.int32)       # [R, W]
        out[have] = ahead[[pos[want[r]] for r in have]]
        missing = [r for r, key in enumerate(want) if key not in pos]
        if missing:
            out[missing] = self._row_masks([seqs[r] for r in missing], vocab_size)
        return out

    def _row_masks(self, seqs: Sequence[ScheduledSeq], vocab_size: int) -> torch.Tensor:
        """[R, ceil(V/32)] int32 on the CPU: bit b of word w set where row r's grammar allows token 32*w + b."""
        return _fill([self._state(s, vocab_size).matcher for s in seqs], vocab_size)

    # ── state ───────────────────────────────────────────────────────────────────────────────────
    def _state(self, s: ScheduledSeq, vocab_size: int) -> _State:
        st = self._states.get(s.request_id)
        begin = self.begin(s)
        if begin is None:
            raise RuntimeError("grammar asked for inside a think block")
        if st is None or st.begin != begin:
            compiled = _spec(s).compiled
            if compiled is None:
                raise RuntimeError("structured output without a compiled grammar")
            if compiled.vocab_size != vocab_size:
                raise RuntimeError(f"grammar compiled for {compiled.vocab_size} tokens, logits have {vocab_size}")
            st = self._states[s.request_id] = _State(compiled.template.deep_copy(), begin=begin)
        out = s.output_token_ids[begin:]
        if st.consumed > len(out):    # tokens the scheduler dropped: forget them
            st.matcher.rollback(st.consumed - len(out))
            st.consumed = len(out)
        if st.consumed < len(out):    # state rebuilt (new matcher, resumed request): replay the output
            st.matcher.consume_tokens(list(out[st.consumed:]))
            st.consumed = len(out)
        return st

    def accept(self, seqs: Sequence[ScheduledSeq], rows: list[int], tokens: Sequence[int], vocab_size: int) -> None:
        """Feed each constrained row its sampled token; then start the next step's masks of the rows
        whose grammar goes on, on the helper thread (unless `overlap` is False)."""
        self._settle()
        ahead: list[tuple[str, int]] = []
        matchers: list[llguidance.LLMatcher] = []
        for i in rows:
            st = self._states.get(seqs[i].request_id)
            if st is None:
                continue
            if self._may_open(seqs[i]) == int(tokens[i]):
                continue                  # the output opened a think block: the grammar waits for its end
            if not st.matcher.consume_token(int(tokens[i])):
                log.warning("request %s: grammar rejected token %d: %s", seqs[i].request_id, tokens[i],
                            st.matcher.get_error())
            st.consumed += 1
            if not (st.matcher.is_stopped() or st.matcher.is_error()):
                ahead.append((seqs[i].request_id, st.begin + st.consumed))
                matchers.append(st.matcher)
        if ahead and self.overlap is not False:
            self._pending = (ahead, self._submit(_fill, matchers, vocab_size))


def _fill(matchers: Sequence[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32: each matcher's allowed tokens in its row."""
    bitmask = torch.zeros(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)  # [R, W]
    words = bitmask.shape[1]
    # one matcher after the other: llguidance's parallel executor hands rows to a thread pool,
    # which on a busy small machine costs far more than the masks (docs/benchmarks.md)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
    return bitmask


# byte value → the additive mask of its 8 tokens: 0.0 where bit k of the byte is set (allowed), -inf where not
_BYTE_MASKS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0.0),
                       np.float32(-np.inf)).astype(np.float32)                   # [256, 8]


def add_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
                buffer: np.ndarray | None = None) -> np.ndarray:
    """CPU: logits[rows] += 0 / -inf from the packed bitmask, by a byte → 8 floats table lookup.

    torch's masked_fill_ with a [R, V] bool mask is a scalar loop on the CPU, several times slower than
    one vectorized add of a float mask, and either torch op is a parallel region of the step's OpenMP
    team, which stalls whenever one of its threads is descheduled; numpy adds on this thread alone
    (docs/benchmarks.md). Adding 0.0 leaves an allowed logit unchanged and finite + -inf is -inf, so
    the logits equal masked_fill's. Returns the float mask's buffer, for the next call to reuse."""
    # logits: [B, V] float; bitmask: [R, W] int32 (CPU), token 32*w + b at bit b of word w
    R, W = bitmask.shape
    V = logits.shape[1]
    if buffer is None or buffer.shape[0] < R or buffer.shape[1] != 4 * W:
        buffer = np.empty((R, 4 * W, 8), dtype=np.float32)
    out = buffer[:R]
    # little-endian words: byte j of word w holds tokens 32*w + 8*j ... + 7, bit k ↔ token + k
    np.take(_BYTE_MASKS, bitmask.numpy().view(np.uint8), axis=0, out=out, mode="clip")   # [R, 4W, 8]
    add = out.reshape(R, 32 * W)[:, :V]
    if logits.dtype != torch.float32:
        x = torch.from_numpy(add)
        for r, i in enumerate(rows):
            logits[i].add_(x[r])
        return buffer
    lg = logits.numpy()                        # a view: the add is in place on the logits
    if len(rows) == logits.shape[0]:           # rows ascend, so these are all rows
        np.add(lg, add, out=lg)
    else:
        for r, i in enumerate(rows):
            np.add(lg[i], add[r], out=lg[i])
    return buffer


def fill_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Any device: the packed bitmask travels (1 bit per token), is unpacked there and masked_fill_ed."""
    R, W = bitmask.shape
    V = logits.shape[1]
    bits = bitmask.to(logits.device, non_blocking=True)                              # [R, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    forbid = (((bits.unsqueeze(-1) >> shifts) & 1) == 0).view(R, 32 * W)[:, :V]       # [R, V] bool
    if len(rows) == logits.shape[0]:          # rows ascend, so these are all rows
        logits.masked_fill_(forbid, float("-inf"))
    else:
        for r, i in enumerate(rows):
            logits[i].masked_fill_(forbid[r], float("-inf"))
