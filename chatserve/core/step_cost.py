"""What a step costs, learned from the steps the runner has timed: how many prompt tokens fit in a time.

A step that runs decoders and a prompt chunk takes about the decoders' own step plus the chunk's work, and
that work grows with the chunk's length n and with the keys each of its tokens attends to (its context
starts at position s):

    prompt seconds(n, s) ≈ c_fixed + c_tok · n + c_attn · n · (s + n / 2)

(c_fixed: what a prompt chunk costs whatever its length, e.g. the second read of the weights that a
batch-invariant mixed step does). The decoders' step is an EMA of the recent decode-only steps (when there
has been none for a while, the scheduler runs one); the three c are a least-squares fit, with exponential
forgetting, of every step with prompt tokens (its time less the decoders' estimate). The
scheduler asks `prompt_tokens_within(seconds, s)` to size a chunk beside decoders by time instead of by a
token count: a 4,000-token prompt's last chunks cost several times its first ones per token, so a fixed
token cap is either too loose late or too tight early (docs/benchmarks.md, "A long prompt beside decoding
streams"). Pure Python: the runner's timings come in through RunnerOutput.
"""
from __future__ import annotations

import math

from chatserve.core.outputs import SchedulerOutput

_DECODE_EMA = 0.2       # weight of the newest decode-only step
_FORGET = 0.9           # weight the older prompt observations keep at each new one
_ATTN_UNIT = 1024.0     # c_attn is fitted per 1,024 token·keys, so both unknowns have similar scales
_DECODE_REFRESH = 64    # steps after which the decode estimate is stale (the decoders have changed)
_OUTLIER = 2.0          # a prompt step counts as at most this many times its predicted time


def prompt_work(out: SchedulerOutput) -> tuple[int, int, float]:
    """(decode rows, prompt tokens, prompt token·keys / _ATTN_UNIT) of one step. A decode row computes one
    token (or one token and its drafts); every other chunk is prompt work (a prompt, or a preempted
    request's prompt + outputs being recomputed)."""
    rows = tokens = 0
    attn = 0.0
    for s in out.seqs:
        n = len(s.token_ids)
        if n == 1 or s.draft_token_ids:
            rows += 1
        else:
            tokens += n
            attn += n * (s.start_pos + n / 2) / _ATTN_UNIT
    return rows, tokens, attn


class StepCost:
    """Online estimates of a decode step's time and of a prompt chunk's extra time (module docstring)."""

    def __init__(self) -> None:
        self.decode_s: float | None = None     # EMA of decode-only steps
        self._since_decode = 0                 # steps observed since the last decode-only one
        # decayed normal equations of  extra ≈ c · (1, tokens, token·keys / U)
        self._m = [[0.0] * 3 for _ in range(3)]
        self._v = [0.0] * 3
        self.coef = (0.0, 0.0, 0.0)            # (c_fixed, c_tok, c_attn)
        self.num_prompt_steps = 0

    @property
    def ready(self) -> bool:
        """Some prompt work has been timed."""
        return self.num_prompt_steps > 0 and sum(self.coef) > 0

    @property
    def decode_stale(self) -> bool:
        """No decode-only step timed yet, or none for a while: the scheduler runs one before it sizes
        chunks by this estimate (a long prompt beside decoders may leave none for minutes otherwise)."""
        return self.decode_s is None or self._since_decode >= _DECODE_REFRESH

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """Fold one timed step in."""
        if seconds <= 0:
            return
        rows, tokens, attn = prompt_work(out)
        if tokens == 0:
            if rows:
                d = self.decode_s
                self.decode_s = seconds if d is None else d + _DECODE_EMA * (seconds - d)
                self._since_decode = 0
            return
        self._since_decode += 1
        # a prompt-only step's fixed part (one read of the weights) is charged to c_fixed: a
        # conservative estimate of what the same chunk adds beside decoders
        extra = max(seconds - (self.decode_s or 0.0) if rows else seconds, 0.0)
        if self.ready:      # one step stalled by something else (a busy host) moves the fit, within bounds
            extra = min(extra, _OUTLIER * self._predict(tokens, attn))
        f = (1.0, float(tokens), attn)
        m, v = self._m, self._v
        for i in range(3):
            v[i] = _FORGET * v[i] + f[i] * extra
            for j in range(3):
                m[i][j] = _FORGET * m[i][j] + f[i] * f[j]
        self.num_prompt_steps += 1
        self.coef = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        """Least squares over the largest set of terms whose coefficients come out non-negative (the
        context term needs chunks at several positions to be told from the per-token one)."""
        for terms in ((0, 1, 2), (1, 2), (0, 1), (1,)):
            c = _solve([[self._m[i][j] for j in terms] for i in terms], [self._v[i] for i in terms])
            if c is not None and all(x >= 0 for x in c):
                out = [0.0, 0.0, 0.0]
                for i, x in zip(terms, c):
                    out[i] = x
                return out[0], out[1], out[2]
        return self.coef

    def _predict(self, tokens: float, attn: float) -> float:
        c0, c1, c2 = self.coef
        return c0 + c1 * tokens + c2 * attn

    def prompt_seconds(self, tokens: int, start: int) -> float:
        """Predicted extra time of a prompt chunk of `tokens` tokens from position `start`."""
        return self._predict(tokens, tokens * (start + tokens / 2) / _ATTN_UNIT)

    def prompt_tokens_within(self, seconds: float, start: int) -> int:
        """The longest chunk from `start` predicted to take at most `seconds` (0 if none fits): the
        positive root of (c_attn / 2U) n² + (c_tok + c_attn · s / U) n + c_fixed = seconds."""
        c0, c1, c2 = self.coef
        room = seconds - c0
        if room <= 0:
            return 0
        a = c2 / (2 * _ATTN_UNIT)
        b = c1 + c2 * start / _ATTN_UNIT
        if a <= 0:
            return int(room / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 4 * a * room)) / (2 * a))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with m x = v (Gaussian elimination with partial pivoting), None if m is near singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        p = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[p][col]) <= 1e-9 * scale:
            return None
        a[col], a[p] = a[p], a[col]
        for r in range(col + 1, n):
            k = a[r][col] / a[col][col]
            for j in range(col, n + 1):
                a[r][j] -= k * a[col][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x
