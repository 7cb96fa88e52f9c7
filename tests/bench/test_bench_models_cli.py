"""`chatserve bench models` and `bench load` against a port nobody listens on: one line naming the bench and
the error on stderr, exit 1 (chatserve.bench.report.run_to_results), never a traceback."""
from __future__ import annotations

import socket

import pytest

from chatserve.bench import load, models


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("bench, name, extra", [(models, "models", []), (load, "load", ["--no-progress"])])
def test_an_unreachable_server_is_one_line_and_exit_1(bench, name, extra, capsys):
    rc = bench.main(["--url", f"http://127.0.0.1:{_closed_port()}", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err and err[-1].startswith(f"chatserve bench {name}: ") and "Traceback" not in "\n".join(err)
