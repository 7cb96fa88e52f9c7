"""A scripted stand-in for the model runner, shared by the scheduler tests (no torch).

The next token is a fixed function of the whole context (and seed). The paged model writes token ids
into (block, offset) slots through the block tables and reads each sampling sequence's context back,
so a wrong block table, a missing copy-on-write or a bad prefix hit changes the output.
"""
from __future__ import annotations

from typing import Callable

from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import SamplingParams

NextToken = Callable[[tuple[int, ...], "int | None", int], int]


def next_token(ctx: tuple[int, ...], seed: int | None, vocab: int) -> int:
    return hash((ctx, -1 if seed is None else seed)) % vocab


ECHO_PERIOD = 7


def echo_next_token(ctx: tuple[int, ...], seed: int | None, vocab: int) -> int:
    """A model that mostly repeats what it saw ECHO_PERIOD tokens ago (so prompt-lookup drafts are often
    right) and says something else about one time in five (so some drafts are rejected)."""
    h = next_token(ctx, seed, 1 << 30)
    if len(ctx) < ECHO_PERIOD or h % 5 == 0:
        return h % vocab
    return ctx[-ECHO_PERIOD]


def reference(prompt: list[int], params: SamplingParams, seed: int | None, max_len: int, *,
              vocab: int, eos: int, next_fn: NextToken = next_token) -> list[int]:
    """What the scheduler must produce for one sequence: the scripted model run alone, with its stops."""
    out: list[int] = []
    while True:
        t = next_fn(tuple(prompt + out), seed, vocab)
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t == eos):
            return out
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_len:
            return out


class PagedSimModel:
    """Runs a SchedulerOutput the way a paged model would, on token ids instead of K/V.

    Memory is slot → token ((block, offset) keys). Copy ops copy whole blocks, every scheduled token
    is written at its slot, then each sampling sequence (unless the step errors it) reads its context
    back through its block table.
    """

    def __init__(self, block_size: int, vocab: int, next_fn: NextToken = next_token) -> None:
        self.bs = block_size
        self.vocab = vocab
        self.next_fn = next_fn
        self.mem: dict[tuple[int, int], int] = {}

    def step(self, out: SchedulerOutput, errors: dict[str, str] | None = None) -> RunnerOutput:
        bs, mem, errors = self.bs, self.mem, dict(errors or {})
        for op in out.copy_ops:
            for o in range(bs):
                if (op.src, o) in mem:
                    mem[(op.dst, o)] = mem[(op.src, o)]
                else:
                    mem.pop((op.dst, o), None)
        for s in out.seqs:
            assert len(s.block_table) * bs >= s.seq_len, "block table too short"
            for j, t in enumerate(s.token_ids):
                p = s.start_pos + j
                mem[(s.block_table[p // bs], p % bs)] = t
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        for s in out.seqs:
            if s.sample and s.request_id not in errors:
                ctx = tuple(mem[(s.block_table[p // bs], p % bs)] for p in range(s.seq_len))
                drafts = s.draft_token_ids
                if not drafts:
                    sampled[s.request_id] = self.next_fn(ctx, s.seed, self.vocab)
                    continue
                # verify: the model's token after each of the last k+1 positions, read back from memory
                base = s.seq_len - len(drafts)
                got = []
                for i in range(len(drafts) + 1):
                    t = self.next_fn(ctx[:base + i], s.seed, self.vocab)
                    got.append(t)
                    if i == len(drafts) or t != drafts[i]:
                        break
                accepted[s.request_id] = got
                sampled[s.request_id] = got[-1]
        return RunnerOutput(step_id=out.step_id, sampled=sampled, errors=errors, accepted=accepted)
