"""Shared pytest setup: the book build, the pages of the TOC, and xdist grouping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from labkit.busy import busy_note, timeout_scale

ROOT = Path(__file__).resolve().parent

# Idle OpenMP threads sleep instead of spinning (GNU OpenMP, which torch's CPU build uses, spins
# for a while by default). The processes the suite starts (kernels, ranks, gradings) share a
# 2-core machine, where a spinning thread holds the core another process needs: two labs run side
# by side took 62 CPU-s spinning, 45 sleeping (scripts/results/suite_times.md). Thread counts,
# and so every result, are unchanged. A value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The Chinese labs (scripts/zh_labs.py) are the English ones with translated Markdown, comments
# and printed text, run: tests/test_i18n.py checks that their code is the English code token for
# token and that their outputs hold the English outputs' numbers, so nbval need not run them too.
collect_ignore_glob = ["labs/zh/*"]


# Labs whose cells check an equivalence against round-off (accumulated = full batch, ...): all
# their cells carry the ``roundoff`` mark, so ``pytest -m roundoff`` re-runs them from the top
# (tests/test_cross_machine.py does, under another CPU kernel setting).
ROUNDOFF_LABS = ("labs/04_accumulation.ipynb",)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """nbval runs a notebook's cells in order in one kernel: send them to one worker. The tests
    that read the built book go last, so that it builds in the background while the rest run,
    and the workers share them."""
    for item in items:
        if item.path.suffix == ".ipynb":
            notebook = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group("nbval:" + notebook))
            path = item.path.resolve()
            if path.is_relative_to(ROOT) and path.relative_to(ROOT).as_posix() in ROUNDOFF_LABS:
                item.add_marker(pytest.mark.roundoff)
    book = [item for item in items if "built_book" in getattr(item, "fixturenames", ())]
    if book:
        ids = set(map(id, book))
        items[:] = [item for item in items if id(item) not in ids] + book


def pytest_configure(config: pytest.Config) -> None:
    """nbval starts each lab's kernel as tests/nbval_kernel.py does: over Unix sockets, with
    patience on a busy machine."""
    if config.pluginmanager.hasplugin("nbval"):
        import nbval.plugin

        if str(ROOT / "tests") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests"))
        from nbval_kernel import PatientKernel

        nbval.plugin.RunningKernel = PatientKernel


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A lab's cell waits for its outputs longer on a slow machine (tests/nbval_kernel.py)."""
    _warm_fork_servers()
    if item.path.suffix == ".ipynb" and hasattr(item, "output_timeout"):
        from nbval_kernel import output_seconds

        item.output_timeout = output_seconds()


def _warm_fork_servers() -> None:
    """labkit.dist's fork server, in this process and in those it starts (gradings, scripts, the
    labs' kernels), is forked from this process's torch server
    (tests/warm_kernels.py), which imported what it preloads, instead of starting as a fresh
    interpreter: 2 to 3 CPU-seconds each (labkit/fork_server.py; scripts/results/suite_times.md).
    A value already set (by the process that started this one) is kept."""
    from labkit.fork_server import KNOB

    if KNOB not in os.environ:
        if str(ROOT / "tests") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests"))
        import warm_kernels

        os.environ[KNOB] = warm_kernels.fork_server_knob() or ""


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


def _shared_dir(config: pytest.Config) -> Path:
    """A folder all xdist workers of this run share (the run's base temp); the run's own."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _start_book_build(config: pytest.Config) -> Path:
    """Start tests/book_build.py in the background, once per run (the first worker to ask starts
    it); return the folder whose result.json it writes when done."""
    out = _shared_dir(config) / "book"
    out.mkdir(exist_ok=True)
    try:
        os.close(os.open(out / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return out  # another worker started it
    with open(out / "build.log", "w") as log:
        subprocess.Popen([sys.executable, str(ROOT / "tests" / "book_build.py"), str(out)], cwd=ROOT,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return out


def pytest_collection_finish(session: pytest.Session) -> None:
    """The book builds in the background from the start when a collected test needs it."""
    if any("built_book" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_book_build(session.config)


@pytest.fixture(scope="session")
def built_book(request: pytest.FixtureRequest) -> BookBuild:
    """The book, both editions, built once per run exactly as README.md tells a newcomer:
    a clone, a virtual environment made inside it, then the README's build command in that
    environment (tests/book_build.py, started in the background when the tests are collected;
    the book's tests run last, on every worker, and wait here for it).
    """
    out = _start_book_build(request.config)
    result, deadline = out / "result.json", time.monotonic() + 1800 * timeout_scale()
    while not result.is_file():
        if time.monotonic() > deadline:
            log = (out / "build.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"the book build did not finish within {1800 * timeout_scale():g} s "
                        f"({busy_note() or 'the machine is not busy'}):\n{log}")
        time.sleep(1)
    data = json.loads(result.read_text())
    if data["skip"]:
        if os.environ.get("CI") == "true":
            pytest.fail(data["skip"])
        pytest.skip(data["skip"])
    return BookBuild(data["returncode"], data["log"], Path(data["html"]))
