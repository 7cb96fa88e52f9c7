"""Sampler: statistical checks of truncation, seeds, logit_bias, penalties and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from chatserve.core.outputs import ScheduledSeq
from chatserve.core.request import SamplingParams
from chatserve.runtime.sampler import Sampler

N = 10_000  # draws per statistical check (one batched call)


def seq(rid: str = "r", *, prompt: list[int] | None = None, output: list[int] | None = None,
        seed: int | None = None, **params) -> ScheduledSeq:
    return ScheduledSeq(request_id=rid, token_ids=[0], start_pos=0, block_table=[0], sample=True,
                        params=SamplingParams(**params), prompt_token_ids=prompt or [],
                        output_token_ids=output or [], seed=seed)


def draw(probs: list[float], n: int = N, **params) -> torch.Tensor:
    """n independent samples of one distribution, as a batch of n identical rows → counts per token."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    toks, _ = Sampler()(logits, [seq(f"r{i}", **params) for i in range(n)])
    return torch.bincount(torch.tensor(toks), minlength=len(probs)).double() / n


def reference(probs: list[float], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0) -> torch.Tensor:
    """The intended distribution, written the slow, obvious way."""
    p = torch.softmax(torch.tensor(probs, dtype=torch.float64).log() / temperature, dim=0)
    p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
    order = p.argsort(descending=True).tolist()
    if top_k:
        for t in order[top_k:]:
            p[t] = 0.0
    p = p / p.sum()
    mass = 0.0
    for rank, t in enumerate(order):
        if rank > 0 and mass >= top_p:
            p[t] = 0.0
        mass += float(p[t]) if p[t] > 0 else 0.0
    return p / p.sum()


def assert_matches(freq: torch.Tensor, expected: torch.Tensor, n: int = N) -> None:
    sampled = set((freq > 0).nonzero().flatten().tolist())
    assert sampled <= set((expected > 0).nonzero().flatten().tolist())  # nothing outside the allowed set
    assert sampled >= set((expected * n >= 20).nonzero().flatten().tolist())  # every likely token shows up
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((freq - expected).abs() <= 5 * sigma + 1e-3).all()), (freq, expected)


PROBS = [0.30, 0.22, 0.15, 0.12, 0.08, 0.06, 0.04, 0.02, 0.007, 0.003]


def test_plain_sampling_follows_softmax():
    assert_matches(draw(PROBS), reference(PROBS))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(temperature):
    assert_matches(draw(PROBS, temperature=temperature), reference(PROBS, temperature=temperature))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k(k):
    freq = draw(PROBS, top_k=k)
    assert set((freq > 0).nonzero().flatten().tolist()) == set(range(k))
    assert_matches(freq, reference(PROBS, top_k=k))


@pytest.mark.parametrize("p", [0.3, 0.5, 0.8, 0.95])
def test_top_p(p):
    assert_matches(draw(PROBS, top_p=p), reference(PROBS, top_p=p))


def test_top_p_keeps_smallest_set_reaching_p():
    freq = draw([0.4, 0.3, 0.15, 0.1, 0.05], top_p=0.8)
    assert set((freq > 0).nonzero().flatten().tolist()) == {0, 1, 2}  # 0.4 + 0.3 < 0.8 ≤ 0.85


@pytest.mark.parametrize("m", [0.1, 0.3, 0.6])
def test_min_p(m):
    assert_matches(draw(PROBS, min_p=m), reference(PROBS, min_p=m))


def test_combined_truncation():
    params = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    assert_matches(draw(PROBS, **params), reference(PROBS, **params))


@pytest.mark.parametrize("scale,size", [(3.0, (2, 64)), (2.0, (64, 1024)), (0.1, (1024, 3000))])
def test_top_p_large_vocab(scale, size):
    """Nuclei served by each pass: the 64 best tokens, the 1024 best, and the full sort."""
    V = 3000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * scale
    probs = torch.softmax(logits.double(), 0)
    n = 2000
    toks, _ = Sampler()(logits.float().expand(n, -1).contiguous(), [seq(f"r{i}", top_p=0.9) for i in range(n)])
    expected = reference(probs.tolist(), top_p=0.9)
    allowed = set((expected > 0).nonzero().flatten().tolist())
    assert size[0] < len(allowed) <= size[1]
    assert set(toks) <= allowed
    freq = torch.bincount(torch.tensor(toks), minlength=V).double() / n
    # Too many tokens for per-token frequencies: compare the mass of 8 bins of tokens ranked by probability.
    order = expected.argsort(descending=True)[: len(allowed)]
    for chunk in order.chunk(8):
        e, f = float(expected[chunk].sum()), float(freq[chunk].sum())
        assert abs(f - e) <= 5 * math.sqrt(e * (1 - e) / n) + 1e-3, (f, e)


def test_greedy_fast_path_is_argmax():
    logits = torch.randn(5, 100)
    toks, lps = Sampler()(logits, [seq(f"r{i}", temperature=0.0) for i in range(5)])
    assert toks == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_seed_reproducible_alone_and_in_batch():
    V, steps = 50, 30
    g = torch.Generator().manual_seed(1)
    mine = [torch.randn(V, generator=g) for _ in range(steps)]

    def run(batch_others: int, seed: int) -> list[int]:
        s, out = Sampler(), []
        for t in range(steps):
            others = torch.randn(batch_others, V)
            logits = torch.cat([others[: batch_others // 2], mine[t][None], others[batch_others // 2:]])
            seqs = [seq(f"o{i}", temperature=0.9, top_k=i % 5, seed=(i if i % 2 else None))
                    for i in range(batch_others)]
            me = seq("me", temperature=1.0, top_p=0.95, seed=seed, output=list(out))
            seqs.insert(batch_others // 2, me)
            toks, _ = s(logits, seqs)
            out.append(toks[batch_others // 2])
        return out

    alone = run(0, seed=1234)
    assert run(7, seed=1234) == alone
    assert run(3, seed=1234) == alone
    assert run(0, seed=4321) != alone


def test_seed_survives_dropped_state():
    """A request re-admitted after its generator was dropped continues the same random stream."""
    V = 40
    logits = [torch.randn(V) for _ in range(10)]
    s, out = Sampler(), []
    for t in range(10):
        out.append(s(logits[t][None], [seq("a", seed=7, output=list(out))])[0][0])
    s2, out2 = Sampler(), []
    for t in range(10):
        if t == 5:
            s2.drop(["a"])
        out2.append(s2(logits[t][None], [seq("a", seed=7, output=list(out2))])[0][0])
    assert out == out2


def test_logit_bias_forces_and_bans():
    probs = [0.9, 0.05, 0.03, 0.02]
    assert draw(probs, n=2000, logit_bias={3: 100.0})[3] == 1.0                 # +100 forces
    assert draw(probs, n=2000, temperature=0.0, logit_bias={3: 100.0})[3] == 1.0
    freq = draw(probs, n=5000, temperature=1.5, logit_bias={0: -100.0})
    assert freq[0] == 0.0 and float(freq[1:].sum()) == pytest.approx(1.0)                             # -100 bans
    toks, _ = Sampler()(torch.tensor(probs).log()[None], [seq(temperature=0.0, logit_bias={0: -100.0})])
    assert toks == [1]
    toks, _ = Sampler()(torch.tensor(probs).log()[None], [seq(temperature=0.0, logit_bias={99: 5.0})])
    assert toks == [0]                                                           # out of vocab: ignored


def processed(logits: torch.Tensor, **params) -> torch.Tensor:
    """The processed log-distribution, read back through full-vocabulary logprobs."""
    V = logits.shape[0]
    _, lps = Sampler(max_top_logprobs=V)(logits[None], [seq(logprobs=V, temperature=0.0, **params)])
    out = torch.full((V,), float("nan"))
    for t, lp in lps[0].top:
        out[t] = lp
    return out


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([2.0, -1.0, 1.0, -2.0, 0.5, 0.0])
    got = processed(logits, repetition_penalty=2.0, prompt=[0, 1], output=[2, 2])
    want = torch.log_softmax(torch.tensor([1.0, -2.0, 0.5, -2.0, 0.5, 0.0]), 0)
    assert torch.allclose(got, want, atol=1e-5)


def test_presence_and_frequency_over_output_only():
    logits = torch.zeros(6)
    got = processed(logits, presence_penalty=0.5, frequency_penalty=0.25, prompt=[0, 1], output=[2, 3, 3, 3])
    want = torch.log_softmax(torch.tensor([0.0, 0.0, -0.75, -1.25, 0.0, 0.0]), 0)
    assert torch.allclose(got, want, atol=1e-5)
    got = processed(logits, presence_penalty=-1.0, output=[4])                    # negative: encourages
    assert int(got.argmax()) == 4


def test_logprobs_sanity():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 200, generator=g)
    seqs = [seq("a", logprobs=5), seq("b", temperature=0.0, logprobs=3), seq("c"), seq("d", logprobs=0, top_k=2)]
    toks, lps = Sampler()(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    assert lps[2] is None
    for i in (0, 1, 3):
        lp = lps[i]
        assert lp.token_id == toks[i]
        assert math.isclose(lp.logprob, float(ref[i, toks[i]]), abs_tol=1e-5)  # before temperature/top_k
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and sum(math.exp(v) for v in vals) <= 1.0 + 1e-6
        assert [t for t, _ in lp.top] == ref[i].topk(len(lp.top)).indices.tolist()
    assert len(lps[0].top) == 5 and len(lps[1].top) == 3 and lps[3].top == []
    assert lps[1].top[0][0] == toks[1]                                           # greedy picks the best
    full = processed(logits[0])
    assert math.isclose(float(torch.logsumexp(full, 0)), 0.0, abs_tol=1e-5)    # a distribution


def test_greedy_token_leads_its_ties_in_top_logprobs():
    # bf16 logits tie often; argmax and topk may break a tie differently, yet the greedy token is the best
    logits = torch.zeros(6, 300)
    for r in range(6):
        logits[r, torch.arange(r, 300, 7)] = 4.0          # 43 tokens share the maximum
    seqs = [seq(f"g{r}", temperature=0.0, logprobs=5) for r in range(6)]
    toks, lps = Sampler()(logits, seqs)
    for r, (tok, lp) in enumerate(zip(toks, lps)):
        assert logits[r, tok] == 4.0 and lp.top[0][0] == tok and len(lp.top) == 5
        assert len({t for t, _ in lp.top}) == 5 and all(v == lp.top[0][1] for _, v in lp.top)


def test_logprobs_reflect_bias_and_penalties():
    logits = torch.tensor([3.0, 1.0, 0.0, 0.0])
    lp = processed(logits, logit_bias={0: -100.0})
    assert lp[0] < -90 and int(lp.argmax()) == 1


def test_mixed_batch_full_vocab():
    """A 32-row batch over the default model's vocabulary with every kind of parameter at once."""
    V, B = 49152, 32
    logits = torch.randn(B, V) * 3
    kinds = [dict(temperature=0.0), dict(temperature=0.7, top_p=0.9), dict(top_k=40, temperature=0.8),
             dict(min_p=0.05), dict(temperature=1.0, repetition_penalty=1.1, logprobs=5)]
    seqs = [seq(f"r{i}", prompt=list(range(i, 500 + i)), output=[1, 2, 3], seed=i, **kinds[i % len(kinds)])
            for i in range(B)]
    s = Sampler()
    s(logits, seqs)  # warm-up
    toks, lps = s(logits, seqs)
    assert len(toks) == B and all(0 <= t < V for t in toks)
    assert toks[0] == int(logits[0].argmax())                      # row 0 is greedy
