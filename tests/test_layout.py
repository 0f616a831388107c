"""The size limits docs/architecture.md promises: small functions, small classes, and a
module docstring saying each file's job.

A newcomer should be able to read any function on one screen. The limits are counted in
source lines (docstrings included) by walking the syntax tree of every module.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = sorted((ROOT / "dpoptim").rglob("*.py"))
FUNCTION_LINES = 60
CLASS_LINES = 250


def _sizes(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_the_walk_sees_the_package():
    names = {path.name for path in MODULES}
    assert {"optimizer.py", "engine.py", "registry.py", "pld.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_or_class_over_the_limit(path):
    too_long = []
    for node, lines in _sizes(path):
        limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
        if lines > limit:
            too_long.append(f"{node.name} (line {node.lineno}): {lines} lines, limit {limit}")
    assert not too_long, f"{path.relative_to(ROOT)}: split by job: " + "; ".join(too_long)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_its_job(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if path.name == "__main__.py" and len(tree.body) <= 2:
        return  # a two-line entry point
    assert ast.get_docstring(tree), f"{path.relative_to(ROOT)} has no module docstring"


def test_the_limit_check_can_fail(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * FUNCTION_LINES)
    assert [lines for _, lines in _sizes(long)] == [FUNCTION_LINES + 1]
