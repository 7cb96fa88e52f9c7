"""`chatserve bench memory`: figures computed through the real KVCacheManager, on small sizes."""
import json

import pytest

from chatserve.bench import memory


_run = memory.run


def small(**kw):
    args = dict(num_requests=40, budget_slots=8192, speed_seqs=8, speed_len=256)
    args.update(kw)
    return _run(**args)


def test_run_reports_every_key_with_plausible_values():
    r = small()
    for k in ("waste_pct", "waste_pct_bs8", "waste_pct_bs32", "paged_vs_contiguous_concurrency",
              "parallel_sampling_saving", "fork_tree_slots_saved", "append_us", "free_us", "match_us"):
        assert k in r, k
    # internal waste is at most one partial block per request: it grows with the block size
    assert 0 < r["waste_pct_bs8"] < r["waste_pct"] < r["waste_pct_bs32"] < 4
    # 8 samples of 1024 + 128: fork sharing keeps 1024 + 8·128 slots of 8·1152
    assert r["parallel_sampling_saving"] == pytest.approx(1 - 2048 / 9216)
    assert r["parallel_sampling_slots_shared"] == 2048
    assert r["parallel_sampling_saving_prefix_cache"] == pytest.approx(1 - (63 + 8 * 9) * 16 / 9216)
    assert r["fork_tree_slots_saved"] > 0 and 0 < r["fork_tree_saving"] < 1
    assert r["paged_concurrency"] > r["contiguous_concurrency"] == 4
    # releasing blocks behind a 1024-token window lets more long requests run at once
    assert r["sliding_window_1024_vs_full_concurrency"] > 1.0
    assert r["append_us"] > 0 and r["match_us"] > 0 and r["free_us"] > 0
    assert set(r["goals_met"]) == set(memory.GOALS)


def test_waste_matches_the_closed_form():
    # One request, prompt 20, output 5 at block 16: lengths 20..25 all hold 32 slots.
    w = memory.internal_waste([(20, 5)], 16)
    assert w == pytest.approx(100 * sum(32 - n for n in range(20, 26)) / (6 * 32))


def test_main_json_and_table(capsys, monkeypatch):
    monkeypatch.setattr(memory, "run", lambda n, seed=0: small(num_requests=n, seed=seed))
    assert memory.main(["--json", "--requests", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["num_requests"] == 20
    assert memory.main(["--requests", "20"]) == 0
    table = capsys.readouterr().out
    assert "internal waste, block 16" in table and "µs per append" in table
    assert "sliding window 1024" in table
