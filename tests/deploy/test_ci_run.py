"""`.ci/run` in a scratch copy of its folder layout, with every command it calls stubbed on PATH: it
exports CHATSERVE_CI=1 for `make test`, and it fails when no container engine can be started instead of
printing a line and passing."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("redis-server", "chromium", "haproxy", "npm", "dockerd", "debootstrap")


def _scratch(tmp_path: Path, engine_rc: int) -> tuple[Path, dict[str, str]]:
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    (repo / "docker/local").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(ROOT / ".ci/run", repo / ".ci/run")
    (repo / "docker/local/engine.sh").write_text(f"echo engine stub >&2\nexit {engine_rc}\n")
    log = tmp_path / "make.log"
    stubs = {t: "exit 0" for t in TOOLS}
    stubs["make"] = f'echo "make $* CHATSERVE_CI=$CHATSERVE_CI" >> {log}'
    for name, body in stubs.items():
        p = bin_dir / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return repo, env


def _run(tmp_path: Path, engine_rc: int) -> tuple[subprocess.CompletedProcess, str]:
    repo, env = _scratch(tmp_path, engine_rc)
    r = subprocess.run(["bash", str(repo / ".ci/run")], capture_output=True, text=True, env=env, timeout=60)
    log = tmp_path / "make.log"
    return r, log.read_text() if log.exists() else ""


def test_no_container_engine_fails_the_run(tmp_path):
    r, makes = _run(tmp_path, engine_rc=3)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "no container engine" in r.stderr
    assert makes.splitlines() == ["make test CHATSERVE_CI=1"]          # test-deploy never started


def test_with_an_engine_both_targets_run_under_ci(tmp_path):
    r, makes = _run(tmp_path, engine_rc=0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert makes.splitlines() == ["make test CHATSERVE_CI=1", "make test-deploy CHATSERVE_CI=1"]
    assert os.access(ROOT / ".ci/run", os.X_OK)
