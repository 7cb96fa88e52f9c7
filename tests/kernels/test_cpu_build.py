"""The C kernels load wherever their prerequisites are met (a compiler, Linux, the CPU flags the
registry in kernels/cpu_build.py names): a kernel that does not compile is a failure showing the
compiler's error, never a skip. And cpu_build tells its four outcomes apart."""
from __future__ import annotations

import shutil

import pytest
import torch

from chatserve_kernels import cpu_attention, cpu_build, cpu_ops, cpu_qmatmul

NAMES = [p.stem for p in cpu_build.sources()]


def _require_prerequisites(name: str) -> None:
    """Skip (a failure under CHATSERVE_CI=1) only where the machine lacks what the kernel needs."""
    gap = cpu_build._prerequisite_gap(name)
    if gap is not None:
        pytest.skip(f"prerequisites missing for {gap}")


def test_every_c_source_is_a_registered_kernel_or_needs_no_flags():
    assert {"cpu_qmatmul", "cpu_attention", "cpu_ops"} <= set(NAMES)
    assert set(cpu_build.KERNELS) <= set(NAMES), "a registry entry without its .c file"


@pytest.mark.parametrize("name", NAMES)
def test_kernel_builds_and_loads(name):
    _require_prerequisites(name)
    lib = cpu_build.load(cpu_build.sources()[NAMES.index(name)])
    st = cpu_build.status(name)
    assert lib is not None and st.loaded, f"C kernel {name} did not load:\n{st}"


def test_the_models_kernels_are_in_use():
    """What the decode path calls: the int4 matmul, paged attention and the fused ops, not the twins."""
    for name in ("cpu_qmatmul", "cpu_attention", "cpu_ops"):
        _require_prerequisites(name)
    problems = {str(cpu_build.status(n)) for n, ok in (("cpu_qmatmul", cpu_qmatmul.available()),
                                                         ("cpu_attention", cpu_attention.available()),
                                                         ("cpu_ops", cpu_ops.usable(torch.zeros(1))))
                if not ok}
    assert not problems, "\n".join(problems)


def test_a_broken_source_is_a_build_failure_with_the_compilers_error(tmp_path, monkeypatch):
    if cpu_build.compiler() is None:
        pytest.skip("no C compiler on PATH")
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "broken_kernel.c"
    src.write_text("int chatserve_ok(void) { return 1 }\n")           # the missing ';'
    assert cpu_build.load(src) is None
    st = cpu_build.status("broken_kernel")
    assert st.state == cpu_build.BUILD_FAILED and st.prerequisites_met
    assert "broken_kernel.c" in st.detail and "error" in st.detail
    with pytest.raises(cpu_build.BuildError, match="broken_kernel.c"):
        cpu_build.build(src)


def test_missing_prerequisites_are_told_apart(tmp_path, monkeypatch):
    src = tmp_path / "needs_much.c"
    src.write_text("int chatserve_ok(void) { return 1; }\n")
    monkeypatch.setitem(cpu_build.KERNELS, "needs_much", ("no_such_cpu_flag",))
    if cpu_build.compiler() is not None and cpu_build.platform.system() == "Linux":
        assert cpu_build.load(src) is None
        st = cpu_build.status("needs_much")
        assert st.state == cpu_build.CPU_LACKS and "no_such_cpu_flag" in st.detail and not st.prerequisites_met
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))                          # no cc, no gcc
    assert shutil.which("cc") is None and cpu_build.load(src) is None
    want = cpu_build.NO_COMPILER if cpu_build.platform.system() == "Linux" else cpu_build.CPU_LACKS
    assert cpu_build.status("needs_much").state == want
    monkeypatch.setenv(cpu_build.ENV, "0")
    assert cpu_build.load(src) is None and cpu_build.status("needs_much").state == cpu_build.DISABLED
