"""A scripted stand-in for the model runner, shared by the scheduler tests (no torch).

The next token is a fixed function of the whole context (and seed). The paged model writes token ids
into (block, offset) slots through the block tables and reads each sampling sequence's context back,
so a wrong block table, a missing copy-on-write or a bad prefix hit changes the output.
"""
from __future__ import annotations

from chatserve.core.outputs import RunnerOutput, SchedulerOutput
from chatserve.core.request import SamplingParams


def next_token(ctx: tuple[int, ...], seed: int | None, vocab: int) -> int:
    return hash((ctx, -1 if seed is None else seed)) % vocab


def reference(prompt: list[int], params: SamplingParams, seed: int | None, max_len: int, *,
              vocab: int, eos: int) -> list[int]:
    """What the scheduler must produce for one sequence: the scripted model run alone, with its stops."""
    out: list[int] = []
    while True:
        t = next_token(tuple(prompt + out), seed, vocab)
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

    def __init__(self, block_size: int, vocab: int) -> None:
        self.bs = block_size
        self.vocab = vocab
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
        sampled = {}
        for s in out.seqs:
            if s.sample and s.request_id not in errors:
                ctx = tuple(mem[(s.block_table[p // bs], p % bs)] for p in range(s.seq_len))
                sampled[s.request_id] = next_token(ctx, s.seed, self.vocab)
        return RunnerOutput(step_id=out.step_id, sampled=sampled, errors=errors)
