"""Every ```python block of README.md and docs/*.md runs.

The blocks of one file run in order in one fresh namespace (a later block may use what an
earlier one defined), in a temporary working directory. A block whose fence is preceded by
the line ``<!-- not-tested -->`` (blank lines between are allowed) is skipped: use it for
fragments that cannot run alone, and for nothing else.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARK = "<!-- not-tested -->"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


def python_blocks(text: str):
    """``(first line number, source, skipped)`` for each fenced block tagged python."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening.group("fence"), opening.group("info").strip().split()
        indent = len(opening.group("indent"))
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if info and info[0].lower() in ("python", "py"):
            previous = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            blocks.append((i + 2, "\n".join(body) + "\n", previous == SKIP_MARK))
        i = j + 1
    return blocks


def test_block_extraction():
    text = "\n".join([
        "intro",
        "```python",
        "a = 1",
        "```",
        "<!-- not-tested -->",
        "",
        "```python",
        "this is not python",
        "```",
        "```bash",
        "echo no",
        "```",
        "- item:",
        "  ```py",
        "  b = a + 1",
        "  ```",
    ])
    assert python_blocks(text) == [
        (3, "a = 1\n", False),
        (8, "this is not python\n", True),
        (15, "b = a + 1\n", False),
    ]


def test_the_docs_exist_and_have_code():
    names = {p.relative_to(ROOT).as_posix() for p in DOC_FILES}
    assert {"README.md", "docs/quickstart.md", "docs/how-it-works.md", "docs/troubleshooting.md", "docs/api.md"} <= names
    for required in ("README.md", "docs/quickstart.md"):
        blocks = python_blocks((ROOT / required).read_text(encoding="utf-8"))
        assert any(not skipped for _, _, skipped in blocks), f"{required} has no tested python block"


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.relative_to(ROOT).as_posix() for p in DOC_FILES])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    blocks = python_blocks(path.read_text(encoding="utf-8"))
    tested = [(line, source) for line, source, skipped in blocks if not skipped]
    if not tested:
        pytest.skip(f"{path.name} has no tested python block")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_block__"}
    name = path.relative_to(ROOT).as_posix()
    for line, source in tested:
        code = compile(source, f"{name}, block at line {line}", "exec")
        exec(code, namespace)  # noqa: S102 - running our own documentation is the point


def test_api_reference_names_every_public_name():
    import importlib

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = []
    for module_name in ("dpoptim", "dpoptim.data", "dpoptim.accounting", "dpoptim.datasets"):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not re.search(rf"`{re.escape(name)}[`( \[]", text):
                missing.append(f"{module_name}.{name}")
    assert not missing, f"docs/api.md does not document: {', '.join(missing)}"
