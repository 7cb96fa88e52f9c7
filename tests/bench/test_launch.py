"""`chatserve bench launch` on a small random GGUF: each chatserve variant runs in its own process and
reports its load time, peak RSS and decode steps against the bandwidth floor; llama.cpp rows take the
in-place variant's byte count (the same blocks) for their floor."""
from __future__ import annotations

import json

import pytest

from chatserve.bench import launch
from chatserve.bench.gguf_checkpoint import build_gguf


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    return build_gguf(tmp_path_factory.mktemp("launch") / "s.gguf", "Q4_K_M", shape="qwen3-30b-a3b-2l",
                      layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512, ffn=512, experts=8,
                      expert_used=2, expert_ffn=256)


def test_in_place_and_default_rows(small_gguf, capsys):
    assert launch.main(["--model", str(small_gguf), "--variants", "in-place,default", "--batches", "1,2",
                        "--steps", "2", "--warmup", "1", "--context", "8", "--bandwidth-mib", "16",
                        "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rounds"][0]
    assert [r["variant"] for r in rows] == ["in-place", "default"]
    for r in rows:
        assert "error" not in r, r
        assert r["load_s"] > 0 and r["peak_rss_mib"] >= r["peak_rss_mib_load"] > 0
        assert [d["batch"] for d in r["decode"]] == [1, 2]
        for d in r["decode"]:
            assert d["weight_bytes_per_step"] > 0 and d["vs_floor"] > 0
    assert "file's blocks" in rows[0]["backends"]


def test_an_in_place_row_says_whether_its_load_built_or_mapped_the_tiled_cache(small_gguf, tmp_path, monkeypatch,
                                                                                 capsys):
    from chatserve_kernels import env
    monkeypatch.setenv(env.WEIGHT_CACHE, "1")
    monkeypatch.setenv(env.WEIGHT_CACHE_DIR, str(tmp_path / "cache"))      # a fresh cache: the first load builds it
    assert launch.main(["--model", str(small_gguf), "--variants", "in-place,default", "--repeats", "2",
                        "--batches", "1", "--steps", "1", "--warmup", "0", "--context", "8", "--bandwidth-mib", "0",
                        "--json"]) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert [[r.get("tiled_cache") for r in rows] for rows in rounds] == [["built", None], ["mapped", None]]
    assert "(tiled cache mapped)" in launch.format_row(rounds[1][0], 0.001)


def test_llama_cpp_rows_take_the_in_place_byte_count():
    r = {"variant": "llama.cpp", "decode": [{"batch": 1, "step_ms_median": 20.0}]}
    launch.add_floor(r, 10e9, {1: 100_000_000})
    d = r["decode"][0]
    assert d["weight_bytes_per_step"] == 100_000_000
    assert d["floor_ms"] == pytest.approx(10.0) and d["vs_floor"] == pytest.approx(2.0)


def test_llama_cpp_needs_an_interpreter(small_gguf):
    with pytest.raises(SystemExit, match="llama-cpp-python"):
        launch.main(["--model", str(small_gguf), "--variants", "llama.cpp"])
