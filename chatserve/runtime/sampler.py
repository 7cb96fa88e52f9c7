"""Next-token choice for a batch of sequences, each with its own sampling parameters.

Logits → grammar mask → penalties → logit_bias → (logprobs) → temperature → min_p → top_k → top_p → one
draw per row.
Batched tensor ops throughout; Python loops only over rows and over bias entries, never over the vocab.
Not here: stop strings (the detokenizer), EOS / max_tokens (the scheduler).

Order and conventions:
  * grammar mask (structured outputs): rows whose params carry a compiled constraint get the tokens their
    grammar forbids set to -inf first, from one batched bitmask (chatserve.runtime.grammar_masks); rows
    without one pay nothing, and nothing is imported until a constrained row appears.
  * repetition_penalty (vLLM/HF): over prompt + output tokens, logit / p if logit > 0 else logit * p.
  * presence/frequency (OpenAI): over output tokens, logit -= presence * [count > 0] + frequency * count.
  * logit_bias (OpenAI): added after the penalties, so +100 forces and -100 bans a token.
  * logprobs: log_softmax of the logits after penalties and bias, before temperature and truncation
    (the model's distribution as this request shaped it; independent of temperature, so greedy and
    sampled requests report the same numbers, and a banned token never shows up in top_logprobs).
  * min_p is relative to the most likely token after temperature; top_k and top_p then act on what
    is left, top_p renormalized over it; the most likely token always survives.
  * Draws: inverse CDF with one uniform per sampled token. A seeded row takes its uniform from its
    own CPU torch.Generator (seeded from ScheduledSeq.seed, keyed by request_id), so its tokens do
    not depend on what else is in the batch, nor on the device.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from chatserve.core.outputs import ScheduledSeq, TokenLogprob

_GREEDY_EPS = 1e-5  # temperatures below this are greedy
_TOP_P_CANDIDATES = (64, 1024)  # top_p without top_k looks at this many best tokens first, then all


def _is_greedy(seq: ScheduledSeq) -> bool:
    return seq.params.temperature < _GREEDY_EPS


def _has_penalties(seq: ScheduledSeq) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    """Callable: (logits [B, V] float32, seqs) → (token ids, logprobs or None per row)."""

    def __init__(self, max_top_logprobs: int = 20) -> None:
        self.max_top_logprobs = max_top_logprobs
        self._generators: dict[str, torch.Generator] = {}    # seeded requests only
        self._prompt_ids: dict[str, tuple[int, torch.Tensor]] = {}  # request_id → (len, unique prompt ids)
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._masks: Any = None  # chatserve.runtime.grammar_masks.GrammarMasks, made on first use

    def drop(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators, cached prompt ids, grammar matchers) of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._prompt_ids.pop(rid, None)
        if self._masks is not None:
            self._masks.drop(request_ids)

    def _grammar_masks(self) -> Any:
        if self._masks is None:
            from chatserve.runtime.grammar_masks import GrammarMasks
            self._masks = GrammarMasks()
        return self._masks

    def prefetch_masks(self, seqs: list[ScheduledSeq], vocab_size: int) -> None:
        """Before the forward: start the grammar masks of the constrained rows among `seqs` (the rows
        that will sample), so they are computed while the forward runs; nothing without such rows."""
        rows = [s for s in seqs if s.params.structured is not None]
        if rows:
            masks = self._grammar_masks()
            rows = [s for s in rows if masks.begin(s) is not None]     # not inside a think block
        if rows:
            masks.prefetch(rows, vocab_size)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [B, V] float32, row i ↔ seqs[i]
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        B = len(seqs)
        if B == 0:
            return [], []
        c_rows = [i for i in range(B) if seqs[i].params.structured is not None]
        if c_rows:
            c_rows = self._grammar_masks().active_rows(seqs, c_rows)   # a think block first: no grammar yet
        if c_rows:
            self._grammar_masks().apply(logits, seqs, c_rows)   # in place: logits are this step's own
            token_list, logprobs = self._choose(logits, seqs)
            self._masks.accept(seqs, c_rows, token_list, logits.shape[1])
            return token_list, logprobs
        return self._choose(logits, seqs)

    def _choose(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> tuple[list[int], list[TokenLogprob | None]]:
        B = len(seqs)
        greedy = [_is_greedy(s) for s in seqs]
        penal = [_has_penalties(s) for s in seqs]
        biased = [bool(s.params.logit_bias) or _under_min_tokens(s) for s in seqs]
        want_lp = [s.params.logprobs is not None for s in seqs]
        if all(greedy) and not any(penal) and not any(biased) and not any(want_lp):
            return logits.argmax(dim=-1).tolist(), [None] * B  # the fast path: one argmax, one sync

        x = logits.float()  # processed logits: [B, V]; copied before anything writes to it
        if (any(penal) or any(biased)) and x is logits:
            x = x.clone()
        if any(penal):
            self._apply_penalties(x, seqs, [i for i in range(B) if penal[i]])
        if any(biased):
            _apply_bias(x, seqs, [i for i in range(B) if biased[i]])

        logprobs: list[TokenLogprob | None] = [None] * B
        lp_rows = [i for i in range(B) if want_lp[i]]
        lp_all = torch.log_softmax(_take(x, lp_rows), dim=-1) if lp_rows else None  # [L, V]

        tokens = torch.empty(B, dtype=torch.long, device=x.device)
        g_rows = [i for i in range(B) if greedy[i]]
        s_rows = [i for i in range(B) if not greedy[i]]
        if g_rows:
            tokens[g_rows] = _take(x, g_rows).argmax(dim=-1)
        if s_rows:
            tokens[s_rows] = self._sample(_take(x, s_rows), [seqs[i] for i in s_rows])

        token_list = tokens.tolist()
        if lp_all is not None:
            logprobs_rows = self._logprobs(lp_all, [token_list[i] for i in lp_rows], [seqs[i] for i in lp_rows])
            for i, lp in zip(lp_rows, logprobs_rows):
                logprobs[i] = lp
        return token_list, logprobs

    # ── penalties ────────────────────────────────────────────────────────────────────────────────
    def _apply_penalties(self, x: torch.Tensor, seqs: list[ScheduledSeq], rows: list[int]) -> None:
        """In place on x [B, V], touching only the tokens that occurred (work ∝ distinct tokens, not V)."""
        V, dev = x.shape[1], x.device
        rep_r: list[torch.Tensor] = []; rep_t: list[torch.Tensor] = []; rep_p: list[torch.Tensor] = []
        cnt_r: list[torch.Tensor] = []; cnt_t: list[torch.Tensor] = []; cnt_d: list[torch.Tensor] = []
        for i in rows:
            p = seqs[i].params
            out = torch.tensor(seqs[i].output_token_ids, dtype=torch.long)
            out = out[(out >= 0) & (out < V)]
            if p.repetition_penalty != 1.0:
                seen = torch.unique(torch.cat([self._prompt_tensor(seqs[i], V), out]))
                rep_r.append(torch.full_like(seen, i)); rep_t.append(seen)
                rep_p.append(torch.full(seen.shape, p.repetition_penalty))
            if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and out.numel():
                toks, counts = torch.unique(out, return_counts=True)
                cnt_r.append(torch.full_like(toks, i)); cnt_t.append(toks)
                cnt_d.append(p.presence_penalty + p.frequency_penalty * counts.float())
        if rep_r:  # logit / p where positive, logit * p otherwise
            r, t = torch.cat(rep_r).to(dev), torch.cat(rep_t).to(dev)
            pen = torch.cat(rep_p).to(dev)
            v = x[r, t]
            x[r, t] = torch.where(v > 0, v / pen, v * pen)
        if cnt_r:  # logit - presence - frequency * count
            r, t = torch.cat(cnt_r).to(dev), torch.cat(cnt_t).to(dev)
            x[r, t] = x[r, t] - torch.cat(cnt_d).to(dev)

    def _prompt_tensor(self, seq: ScheduledSeq, V: int) -> torch.Tensor:
        """Unique in-vocab prompt ids, cached per request (the prompt does not change while it runs)."""
        n = len(seq.prompt_token_ids)
        cached = self._prompt_ids.get(seq.request_id)
        if cached is None or cached[0] != n:
            ids = torch.unique(torch.tensor(seq.prompt_token_ids, dtype=torch.long))
            cached = (n, ids[(ids >= 0) & (ids < V)])
            self._prompt_ids[seq.request_id] = cached
        return cached[1]

    # ── sampling ─────────────────────────────────────────────────────────────────────────────────
    def _sample(self, x: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        # x: [S, V] processed logits of the rows that sample → token ids [S]
        S, V = x.shape
        dev = x.device
        temp = torch.tensor([s.params.temperature for s in seqs], device=dev).unsqueeze(1)
        x = x / temp
        min_p = [s.params.min_p for s in seqs]
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(x, dim=-1)
            thresh = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            x = x.masked_fill(probs < thresh, float("-inf"))
        u = self._uniforms(seqs).to(dev)  # [S] in [0, 1)

        top_k = [s.params.top_k if 0 < s.params.top_k < V else 0 for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        truncate = [k > 0 or p < 1.0 for k, p in zip(top_k, top_p)]
        out = torch.empty(S, dtype=torch.long, device=dev)
        plain = [r for r in range(S) if not truncate[r]]
        if plain:  # sample over the whole vocabulary, in vocabulary order
            out[plain] = _inverse_cdf(torch.softmax(_take(x, plain), dim=-1), u[plain])
        # Rows that truncate, grouped by how many sorted candidates they need (top_k, or V for top_p
        # alone): a row's arithmetic then never depends on the other rows in the batch.
        groups: dict[int, list[int]] = {}
        for r in range(S):
            if truncate[r]:
                groups.setdefault(top_k[r] or V, []).append(r)
        for k_cap, cut in groups.items():
            if k_cap == V:  # top_p alone: usually a few hundred candidates hold the mass, skip the full sort
                out[cut] = _top_p_only(x[cut], torch.tensor([top_p[r] for r in cut], device=dev), u[cut])
                continue
            vals, idx = x[cut].topk(k_cap, dim=-1)  # [C, K] sorted descending
            probs = torch.softmax(vals, dim=-1)    # renormalized over the top k
            p_row = torch.tensor([top_p[r] for r in cut], device=dev)
            out[cut] = _pick_sorted(probs, idx, p_row, u[cut])
        return out

    def _uniforms(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """One U[0,1) per row: seeded rows from their own generator, the rest from the shared one."""
        u = torch.rand(len(seqs), generator=self._rng)
        for r, s in enumerate(seqs):
            if s.seed is not None:
                u[r] = torch.rand(1, generator=self._generator(s))[0]
        return u

    def _generator(self, seq: ScheduledSeq) -> torch.Generator:
        g = self._generators.get(seq.request_id)
        if g is None:
            assert seq.seed is not None
            g = torch.Generator().manual_seed(seq.seed & 0xFFFF_FFFF_FFFF_FFFF)
            if seq.output_token_ids:  # state lost (restart, re-admission): skip the draws already made
                torch.rand(len(seq.output_token_ids), generator=g)
            self._generators[seq.request_id] = g
        return g

    # ── logprobs ─────────────────────────────────────────────────────────────────────────────────
    def _logprobs(self, lp: torch.Tensor, chosen: list[int], seqs: list[ScheduledSeq]) -> list[TokenLogprob]:
        # lp: [L, V] log-probabilities of the processed distribution
        V = lp.shape[1]
        k = min(V, self.max_top_logprobs, max(s.params.logprobs or 0 for s in seqs))
        chosen_lp = lp.gather(1, torch.tensor(chosen, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        top_v: list[list[float]] = []
        top_i: list[list[int]] = []
        if k > 0:
            values, indices = lp.topk(k, dim=-1)
            top_v, top_i = values.tolist(), indices.tolist()
        out = []
        for r, s in enumerate(seqs):
            n = min(k, s.params.logprobs or 0)
            # -inf alternatives (tokens a grammar mask forbids) are not alternatives
            top = [(i, v) for i, v in zip(top_i[r][:n], top_v[r][:n]) if v != float("-inf")] if n else []
            top = _chosen_first_among_ties(top, chosen[r], chosen_lp[r])
            out.append(TokenLogprob(token_id=chosen[r], logprob=chosen_lp[r], top=top))
        return out


def _chosen_first_among_ties(top: list[tuple[int, float]], chosen: int, chosen_lp: float
                             ) -> list[tuple[int, float]]:
    """topk orders equal values arbitrarily: the chosen token leads the alternatives that tie with it,
    so a greedy token is always the first of its top_logprobs."""
    if not top or top[0][0] == chosen or chosen_lp != top[0][1]:
        return top
    return [(chosen, chosen_lp)] + [t for t in top if t[0] != chosen][:len(top) - 1]


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without the copy when rows is every row (in order)."""
    return x if len(rows) == x.shape[0] else x[rows]


def _under_min_tokens(seq: ScheduledSeq) -> bool:
    return seq.params.min_tokens > len(seq.output_token_ids) and bool(seq.params.min_tokens_banned_ids)


def _apply_bias(x: torch.Tensor, seqs: list[ScheduledSeq], rows: list[int]) -> None:
    """logit_bias, and min_tokens: EOS and stop token ids at -inf until that many tokens are out."""
    V = x.shape[1]
    for i in rows:
        if _under_min_tokens(seqs[i]):
            ban = [t for t in seqs[i].params.min_tokens_banned_ids if 0 <= t < V]
            x[i, ban] = float("-inf")
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for i in rows:
        for tok, b in (seqs[i].params.logit_bias or {}).items():
            t = int(tok)
            if 0 <= t < V:
                r_idx.append(i)
                t_idx.append(t)
                vals.append(float(b))
    if r_idx:
        dev = x.device
        x.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                     torch.tensor(vals, device=dev, dtype=x.dtype), accumulate=True)


def _pick_sorted(probs: torch.Tensor, idx: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # probs, idx: [C, K] candidates sorted by descending probability; top_p, u: [C] → token ids [C]
    mass_before = probs.cumsum(dim=-1) - probs  # [C, K] mass of the strictly better candidates
    first = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0) == 0
    probs = probs.masked_fill((mass_before >= top_p.unsqueeze(1)) & ~first, 0.0)
    choice = _inverse_cdf(probs, u)  # [C] positions among the candidates
    return idx.gather(1, choice.unsqueeze(1)).squeeze(1)


def _top_p_only(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # x: [C, V] logits (after temperature), normalized over the whole vocabulary → token ids [C]
    V = x.shape[1]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [C, 1]
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    rows = list(range(x.shape[0]))
    for k in _TOP_P_CANDIDATES + (V,):
        k = min(k, V)
        vals, idx = x[rows].topk(k, dim=-1)  # [R, k]
        probs = torch.exp(vals - lse[rows])  # true probabilities of the k best
        # The nucleus lies within the k best when their mass reaches top_p (or k is everything);
        # each row's outcome depends only on its own logits, not on which pass served it.
        done = torch.ones(len(rows), dtype=torch.bool) if k == V else (probs.sum(dim=-1) >= top_p[rows]).cpu()
        fit = done.nonzero().squeeze(1).tolist()
        if fit:
            sel = [rows[j] for j in fit]
            out[sel] = _pick_sorted(probs[fit], idx[fit], top_p[sel], u[sel])
        rows = [rows[j] for j in range(len(rows)) if not done[j]]
        if not rows:
            break
    return out


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # probs: [N, K] non-negative (need not sum to 1), u: [N] in [0, 1) → column index [N] with probs > 0
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Float round-off can land past the last positive entry: fall back to the most likely token.
    bad = (idx >= probs.shape[1])
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(dim=-1), idx)
    return idx
