"""Fixtures shared by labkit's tests, and the browser session of the book's tests."""

import pytest
import torch

from browser_support import CHROMIUM, CHROMIUM_ARGS, Tab, chromium_or_skip, serving


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors this small gain nothing from threads and lose a lot on a shared 2-core CPU; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def site(built_book):
    """Serve the built HTML on 127.0.0.1 at a port the OS picks (held while serving); yield its URL."""
    if built_book.returncode != 0:
        pytest.fail(f"the book did not build:\n{built_book.log[-3000:]}")
    with serving(built_book.html) as url:
        yield url


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for every page and calculator test of this worker."""
    chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def book_tabs(browser):
    """One browser context for this worker's pages of the book (their tests share a tab of it,
    ``book_tab``): a page's scripts, fonts and MathJax's compiled code come from the cache after
    the first page, as for a reader who opens a second chapter. Tests that route requests (which
    turns the cache off) or block the book's own files open a context of their own."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield context
    finally:
        context.close()


@pytest.fixture(scope="session")
def book_tab(book_tabs):
    """The tab of ``book_tabs`` that this worker's page and calculator tests navigate in turn
    (browser_support.Tab): ``with book_tab.visit() as (page, on): ...``."""
    return Tab(book_tabs)


@pytest.fixture(scope="session")
def warm_kernel_server():
    """This worker's server of grading kernels (tests/warm_kernels.py): the folder to put in
    JUPYTER_PATH so that Jupyter's python3 kernels are forked from it; None without one."""
    import warm_kernels

    return warm_kernels.server("kernel")


@pytest.fixture(scope="session")
def warm_grader_server():
    """This worker's server of exercises.py's steps (otter run, otter assign): the value of
    EXERCISES_PYTHON that forks them from it; None without one."""
    import warm_kernels

    return warm_kernels.server("grader")


@pytest.fixture
def warm_kernels(warm_kernel_server, warm_grader_server, monkeypatch):
    """Jupyter's python3 kernels in this test are forked from warm_kernel_server, and
    scripts/exercises.py's steps from warm_grader_server, where they run."""
    if warm_kernel_server is not None:
        monkeypatch.setenv("JUPYTER_PATH", warm_kernel_server)
    if warm_grader_server is not None:
        monkeypatch.setenv("EXERCISES_PYTHON", warm_grader_server)
    return warm_kernel_server
