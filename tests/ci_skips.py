"""A pytest plugin for CI: with CHATSERVE_CI=1, a skip whose reason is not on ALLOWED (a missing GPU)
is reported as a failure that names the reason, so a test that stops running is seen. Loaded by
tests/conftest.py; it is not a place for fixtures. xfail outcomes are left alone.
"""
from __future__ import annotations

import os
import re

import pytest

ENV = "CHATSERVE_CI"
# The only reasons a test may skip in CI: the machine has no CUDA GPU.
ALLOWED = re.compile(r"\b(CUDA|GPU)\b", re.IGNORECASE)


def active() -> bool:
    return os.environ.get(ENV) == "1"


def skip_reason(longrepr: object) -> str:
    """The reason text of a skip report's longrepr (a (path, line, reason) tuple or a string)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def _forbidden(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a skip CI does not allow, or None."""
    if not (active() and report.skipped) or hasattr(report, "wasxfail"):
        return None
    reason = skip_reason(report.longrepr)
    return None if ALLOWED.search(reason) else reason


def _fail(report: pytest.TestReport | pytest.CollectReport, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"skipped under {ENV}=1, and only a missing GPU may skip in CI.\n"
                       f"Skip reason: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (reason := _forbidden(report)) is not None:
        _fail(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if (reason := _forbidden(report)) is not None:
        _fail(report, reason)
