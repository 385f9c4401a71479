"""Shared pytest setup: the book build, the pages of the TOC, and xdist grouping."""

from __future__ import annotations

import os
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


# What requirements-book.txt leaves out: the book build runs with these made impossible to import,
# as on a machine that installed only the book's set (macOS or Windows, where Triton has no wheel).
NOT_FOR_THE_BUILD = ("torch", "triton", "labkit", "nbval", "otter", "playwright", "hypothesis",
                     "xdist")
_BLOCKER = f"""import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_FOR_THE_BUILD!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (the book build must not "
                                      "need it: requirements-book.txt)", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.fixture(scope="session")
def built_book(tmp_path_factory: pytest.TempPathFactory) -> BookBuild:
    """Build the book, both editions, once per session (per xdist worker) with -W into a
    temporary folder, with torch, Triton, labkit and the test tools impossible to import
    (NOT_FOR_THE_BUILD).

    Tests using it carry ``pytest.mark.xdist_group("book")`` so that one worker builds it.
    """
    out = tmp_path_factory.mktemp("book")
    blocker = tmp_path_factory.mktemp("not_installed")
    (blocker / "sitecustomize.py").write_text(_BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(blocker))  # nor labkit from a PYTHONPATH checkout
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_book.py"), "--path-output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env,
    )
    return BookBuild(proc.returncode, proc.stdout + proc.stderr, out / "_build" / "html")
