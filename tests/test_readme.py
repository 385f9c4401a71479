"""README.md gives one command to build the book and one to run every test; CI runs the latter."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command(section: str) -> str:
    """The single command in the first ```bash block under ``## {section}`` of README.md."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, re.S)
    assert block, f"README section {section!r} has no bash block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, f"README section {section!r} must hold exactly one command: {lines}"
    return lines[0].strip()


def test_build_command_installs_only_the_book_set_then_builds():
    assert _command("Build the book") == (
        "pip install -r requirements-book.txt && python scripts/build_book.py")


def test_setting_up_clones_into_a_virtual_environment():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    body = readme.split("## Setting up\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    assert re.search(r"^git clone https://github\.com/\S+ && cd \S+$", block, re.M), block
    assert "python3 -m venv .venv && . .venv/bin/activate" in block
    assert "externally-managed-environment" in body
    assert "--index-url https://download.pytorch.org/whl/cpu" in body and "Colab" in body


def _requirements(name: str) -> dict[str, str]:
    """{normalised name: pinned version} of a requirements file (its own lines only)."""
    pins = {}
    for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-r "):
            package, sep, version = line.partition("==")
            assert sep and version, f"{name}: {line!r} is not pinned exactly (name==version)"
            pins[re.sub(r"[-_.]+", "-", package).lower()] = version
    return pins


TEST_ONLY = {"triton", "torch", "nbval", "otter-grader", "pytest", "pytest-xdist", "playwright",
             "hypothesis"}


def test_the_book_set_holds_no_triton_torch_or_test_tool():
    book = _requirements("requirements-book.txt")
    assert {"jupyter-book", "django-static-mathjax", "sphinx"} <= set(book)
    assert not TEST_ONLY & set(book), sorted(TEST_ONLY & set(book))


def test_the_test_set_is_the_book_set_plus_torch_and_the_test_tools():
    lines = (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert "-r requirements-book.txt" in lines
    tests = _requirements("requirements.txt")
    assert TEST_ONLY <= set(tests), sorted(TEST_ONLY - set(tests))
    assert not set(tests) & set(_requirements("requirements-book.txt"))  # each pin once


def test_the_build_imports_no_torch_triton_or_labkit():
    """The build script and the book's Sphinx extensions, read statically (the book build of the
    suite (tests/book_build.py) runs in a virtual environment that has only the book's set)."""
    import ast

    sources = [ROOT / "scripts" / "build_book.py", *sorted((ROOT / "_ext").glob("*.py"))]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.split(".")[0] in TEST_ONLY | {"labkit"}]
            assert not bad, f"{path.name} imports {bad}: the book build must not need them"


def test_readme_intro_and_package_agree_on_python():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = (ROOT / "intro.md").read_text(encoding="utf-8")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    needed = re.search(r'requires-python = ">=(3\.\d+)"', pyproject).group(1)
    stated = set(re.findall(r"Python (3\.\d+)", readme + intro))
    assert stated == {needed}, f"README/intro say Python {stated}, pyproject needs {needed}"


def test_ci_runs_exactly_the_readme_test_command():
    cmd = _command("Run every test")
    assert "pytest" in cmd
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run must be executable"
    lines = [ln.strip() for ln in ci.read_text(encoding="utf-8").splitlines()]
    assert "set -euo pipefail" in lines
    assert cmd in lines, f".ci/run does not run the README's test command {cmd!r}"


def test_readme_says_how_to_publish_with_the_one_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    body = readme.split("## How to publish\n", 1)[1].split("\n## ", 1)[0]
    assert "python scripts/set_repo_url.py https://github.com/OWNER/NAME" in body
    assert "--check" in body and "repository.url" in body
    assert (ROOT / "scripts" / "set_repo_url.py").is_file()
