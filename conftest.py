"""Shared pytest setup: the book build, the pages of the TOC, and xdist grouping."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent


# Labs whose cells check an equivalence against round-off (accumulated = full batch, ...): all
# their cells carry the ``roundoff`` mark, so ``pytest -m roundoff`` re-runs them from the top
# (tests/test_cross_machine.py does, under another CPU kernel setting).
ROUNDOFF_LABS = ("labs/04_accumulation.ipynb",)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """nbval runs a notebook's cells in order in one kernel: send them to one worker."""
    for item in items:
        if item.path.suffix == ".ipynb":
            notebook = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group("nbval:" + notebook))
            path = item.path.resolve()
            if path.is_relative_to(ROOT) and path.relative_to(ROOT).as_posix() in ROUNDOFF_LABS:
                item.add_marker(pytest.mark.roundoff)


def toc_pages() -> list[str]:
    """Every page listed in _toc.yml, as docnames without suffix ("chapters/01_memory_wall")."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]

    def walk(entries: list[dict]) -> None:
        for entry in entries:
            if "file" in entry:
                pages.append(entry["file"])
            for key in ("parts", "chapters", "sections"):
                walk(entry.get(key, []))

    walk([toc])
    return [str(Path(p).with_suffix("")) if Path(p).suffix in (".md", ".ipynb") else p
            for p in pages]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run a test that takes ``toc_page`` once for every page of the book."""
    if "toc_page" in metafunc.fixturenames:
        metafunc.parametrize("toc_page", toc_pages())


@dataclass
class BookBuild:
    returncode: int
    log: str
    html: Path  # the _build/html folder (the English edition)

    @property
    def zh_html(self) -> Path:
        """The Chinese edition's folder, inside the English one (scripts/build_book.py)."""
        return self.html / "zh"


def _clone(dest: Path) -> None:
    """What ``git clone`` of this checkout gives: the files git tracks, and those it would track
    (new, not ignored), as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a deleted, not yet committed file is listed but gone
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _run(cmd: list[str], cwd: Path, env: dict, log: list[str], timeout: float) -> int:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    log.append(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.returncode


@pytest.fixture(scope="session")
def built_book(tmp_path_factory: pytest.TempPathFactory) -> BookBuild:
    """The book, both editions, built once per session exactly as README.md tells a newcomer:
    a clone, a virtual environment made inside it (``python3 -m venv .venv``), then the README's
    build command in that environment (``pip install -r requirements-book.txt && python
    scripts/build_book.py``, with -W). The environment holds the book's set only, so the build
    cannot lean on torch, Triton, labkit or a test tool, and the book must not read ``.venv``.

    Tests using it carry ``pytest.mark.xdist_group("book")`` so that one worker builds it.
    """
    clone = tmp_path_factory.mktemp("course")
    _clone(clone)
    venv_python = clone / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv_python.parent.parent),  # what `. .venv/bin/activate` sets
               PATH=os.pathsep.join([str(venv_python.parent), env.get("PATH", "")]))
    log: list[str] = []
    code = _run([sys.executable, "-m", "venv", ".venv"], clone, env, log, 300)
    if code == 0:
        code = _run([str(venv_python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                     "-r", "requirements-book.txt"], clone, env, log, 1200)
        if code != 0 and os.environ.get("CI") != "true":
            pytest.skip("pip could not install requirements-book.txt into a new virtual environment "
                        f"(offline?): the book is built as the README says or not at all\n{log[-1][-2000:]}")
    if code == 0:
        code = _run([str(venv_python), "scripts/build_book.py"], clone, env, log, 1200)
    return BookBuild(code, "\n".join(log), clone / "_build" / "html")
