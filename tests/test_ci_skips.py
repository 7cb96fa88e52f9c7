"""The CI plugin (tests/ci_skips.py) in a child pytest run: under CHATSERVE_CI=1 every skip but a
missing GPU fails and names its reason; without it skips stay skips; xfail is untouched."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent

CASES = """
import pytest

def test_runs():
    assert True

def test_skip_in_body():
    pytest.skip("redis-server not found")

@pytest.mark.skipif(True, reason="no AVX-512 VNNI kernel on this CPU")
def test_skipif_mark():
    pass

@pytest.fixture
def needs_thing():
    pytest.skip("thing unavailable")

def test_skip_in_fixture(needs_thing):
    pass

@pytest.mark.skipif(True, reason="needs CUDA + triton")
def test_no_cuda():
    pass

def test_no_gpu():
    pytest.skip("no GPU on this machine")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_anywhere")

def test_never():
    pass
"""


@pytest.fixture
def child(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.syspathinsert(TESTS)
    pytester.makeconftest("from ci_skips import pytest_make_collect_report, pytest_runtest_makereport\n")
    pytester.makepyfile(test_cases=CASES, test_module_skip=MODULE_SKIP)
    return pytester


def test_ci_turns_forbidden_skips_into_failures(child: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("CHATSERVE_CI", "1")
    res = child.runpytest("-p", "no:cacheprovider", "-rA", "--continue-on-collection-errors")
    outcomes = res.parseoutcomes()
    # a skip in the body fails; one in setup (skipif mark, fixture) or collection (importorskip) errors
    assert outcomes.get("failed") == 1 and outcomes.get("errors") == 3, res.stdout.str()
    assert outcomes.get("skipped") == 2 and outcomes.get("xfailed") == 1 and outcomes.get("passed") == 1
    out = res.stdout.str()
    for reason in ("redis-server not found", "no AVX-512 VNNI kernel on this CPU", "thing unavailable",
                   "no_such_module_anywhere"):
        assert reason in out
    assert res.ret != 0


def test_outside_ci_skips_stay_skips(child: pytest.Pytester, monkeypatch):
    monkeypatch.delenv("CHATSERVE_CI", raising=False)
    res = child.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, skipped=6, xfailed=1)
    assert res.ret == 0
