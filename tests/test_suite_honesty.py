"""The suite's own honesty, read from its source (ast): no guarded imports of the project's modules,
no skip on any exception, no assert that cannot fail (`... or True`), no stale "not there yet" guard.
Each rule names file:line."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

TESTS = Path(__file__).parent
PROJECT = ("chatserve", "chatserve_kernels")
BROAD = {"Exception", "BaseException", "ImportError", "ModuleNotFoundError"}


def _trees() -> list[tuple[Path, ast.AST]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(TESTS.rglob("*.py"))
            if "vendor" not in p.parts and "node_modules" not in p.parts and p != Path(__file__)]


def _is_call(node: ast.AST, name: str) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name)


def _caught(handler: ast.ExceptHandler) -> set[str]:
    t = handler.type
    if t is None:
        return {"BaseException"}
    elts = t.elts if isinstance(t, ast.Tuple) else [t]
    return {e.id if isinstance(e, ast.Name) else getattr(e, "attr", "") for e in elts}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(TESTS.parent)}:{node.lineno}"


def _find(rule: Callable[[ast.AST], bool]) -> list[str]:
    """file:line of every node of the suite for which `rule` holds."""
    return [_where(path, node) for path, tree in _trees() for node in ast.walk(tree) if rule(node)]


def _guarded_project_import(node: ast.AST) -> bool:
    return _is_call(node, "importorskip") and bool(node.args) and isinstance(node.args[0], ast.Constant) \
        and str(node.args[0].value).split(".")[0] in PROJECT


def _skip_on_broad_exception(node: ast.AST) -> bool:
    return isinstance(node, ast.ExceptHandler) and bool(_caught(node) & BROAD) and any(
        _is_call(n, "skip") for stmt in node.body for n in ast.walk(stmt))


def _assert_or_true(node: ast.AST) -> bool:
    return isinstance(node, ast.Assert) and isinstance(node.test, ast.BoolOp) \
        and isinstance(node.test.op, ast.Or) and any(isinstance(v, ast.Constant) and v.value
                                                     for v in node.test.values)


def test_project_modules_are_imported_without_guards():
    bad = _find(_guarded_project_import)
    assert not bad, f"importorskip of the project's own modules turns an ImportError into a skip: {bad}"


def test_no_skip_on_a_broad_exception():
    """`except Exception: pytest.skip(...)` (or ImportError) hides a real error as a skip."""
    bad = _find(_skip_on_broad_exception)
    assert not bad, f"skips on a broad exception: {bad}"


def test_no_assert_or_true():
    bad = _find(_assert_or_true)
    assert not bad, f"asserts that cannot fail: {bad}"


def test_no_stale_not_there_yet_guards():
    """A skip "until X exists" outlives X: the file it guards exists now, so the guard only hides."""
    bad = _find(lambda n: isinstance(n, ast.Constant) and isinstance(n.value, str) and "not there yet" in n.value)
    assert not bad, f"stale 'not there yet' guards: {bad}"
