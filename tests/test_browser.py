"""Every page of the built book, opened in headless Chromium, renders without errors and offline.

Fails on: console errors and page errors, math left untypeset, images that did not load, failed
requests for the book's own files, and any equation or code cell (input or output) wider than its
column at a 1280 px wide window, which would need horizontal scrolling. Requests to any other host are blocked, so a page
that needs the network (for instance MathJax from a CDN) fails. Full-page screenshots are
saved in the test's tmp_path.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LOCAL_HOSTS = {"127.0.0.1", "localhost"}

pytestmark = pytest.mark.xdist_group("book")

# Math left as TeX source, outside code blocks, after MathJax has run: $$, \(, \[, \begin{,
# or $...$ around TeX (a backslash, ^, _ or braces inside).
FIND_RAW_MATH = r"""() => {
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, {
    acceptNode(node) {
      const skip = node.parentElement.closest('pre, code, script, style, mjx-container, textarea');
      return skip ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT;
    }});
  const tex = /\$\$|\\\(|\\\[|\\begin\{|\$[^$\n]*[\\^_{}][^$\n]*\$/;
  const found = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (tex.test(n.textContent)) found.push(n.textContent.trim().slice(0, 80));
  }
  return found;
}"""

# Math elements (Sphinx's span.math / div.math) without MathJax output, and MathJax errors.
FIND_UNTYPESET_MATH = """() => {
  const bad = [];
  for (const el of document.querySelectorAll('.math')) {
    if (!el.querySelector('mjx-container')) bad.push(el.textContent.trim().slice(0, 80));
  }
  for (const el of document.querySelectorAll('mjx-merror')) {
    bad.push('MathJax error: ' + el.textContent.trim().slice(0, 80));
  }
  return {count: document.querySelectorAll('.math').length, bad};
}"""

# Display math and code cells (inputs and outputs) whose content is wider than their box: they
# would need horizontal scrolling. Hidden elements (a closed dropdown) have no width and are skipped.
FIND_OVERFLOW = """() => {
  const sel = 'div.math, mjx-container[display="true"], div.highlight pre, div.cell_output pre';
  const bad = [];
  for (const el of document.querySelectorAll(sel)) {
    if (el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1) {
      bad.push(`${el.tagName.toLowerCase()} ${el.scrollWidth}px in ${el.clientWidth}px: ` +
               el.textContent.trim().replace(/\\s+/g, ' ').slice(0, 70));
    }
  }
  return bad;
}"""

# Load every image now (also the lazy ones) and list those that failed.
FIND_BROKEN_IMAGES = """async () => {
  const imgs = Array.from(document.images);
  for (const img of imgs) img.loading = 'eager';
  await Promise.all(imgs.map(img => img.decode().catch(() => null)));
  return imgs.filter(img => img.naturalWidth === 0).map(img => img.getAttribute('src'));
}"""


def _chromium_or_skip() -> None:
    reason = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reason = "the playwright Python package is not installed"
    if reason is None and not Path(CHROMIUM).is_file():
        reason = f"Chromium not found at {CHROMIUM} (apt-get install chromium)"
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}: the browser test must run in CI")
        pytest.skip(reason)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def site(built_book):
    """Serve the built HTML on 127.0.0.1 at a free port; yield its base URL."""
    if built_book.returncode != 0:
        pytest.fail(f"the book did not build:\n{built_book.log[-3000:]}")
    handler = functools.partial(_QuietHandler, directory=str(built_book.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def test_page_renders_offline(browser, site, toc_page, tmp_path):
    problems: list[str] = []
    blocked: list[str] = []

    def route(r):
        host = urlsplit(r.request.url).hostname
        if host in LOCAL_HOSTS:
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort("blockedbyclient")

    def on_console(msg):
        if msg.type == "error":
            problems.append(f"console error: {msg.text} ({msg.location.get('url', '')})")

    def on_request_failed(req):
        if urlsplit(req.url).hostname in LOCAL_HOSTS:
            problems.append(f"request failed: {req.url} ({req.failure})")

    def on_response(resp):
        if urlsplit(resp.url).hostname in LOCAL_HOSTS and resp.status >= 400:
            problems.append(f"HTTP {resp.status}: {resp.url}")

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.route("**/*", route)
    page = context.new_page()
    page.on("console", on_console)
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("requestfailed", on_request_failed)
    page.on("response", on_response)
    try:
        response = page.goto(f"{site}/{toc_page}.html", wait_until="load", timeout=60_000)
        assert response is not None and response.ok, f"{toc_page}.html: HTTP error"

        has_math = page.evaluate("() => document.querySelectorAll('.math').length > 0")
        if has_math:
            try:
                page.wait_for_function(
                    "() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                    timeout=30_000)
            except Exception:
                pytest.fail(f"{toc_page}: the page has math but MathJax did not start; "
                            f"blocked non-local requests: {blocked}")
            page.evaluate("() => MathJax.startup.promise")
        math = page.evaluate(FIND_UNTYPESET_MATH)
        raw = page.evaluate(FIND_RAW_MATH)
        broken = page.evaluate(FIND_BROKEN_IMAGES)
        overflow = page.evaluate(FIND_OVERFLOW)
        page.wait_for_load_state("networkidle", timeout=30_000)
        shot = tmp_path / f"{toc_page.replace('/', '__')}.png"
        page.screenshot(path=str(shot), full_page=True)
    finally:
        context.close()

    print(f"{toc_page}: {math['count']} math elements; blocked non-local requests: {blocked}; "
          f"screenshot {shot}")
    needed = [u for u in blocked if "mathjax" in u.lower()]
    assert not needed, f"{toc_page} requests MathJax from the network: {needed}"
    assert not math["bad"], f"{toc_page}: math not typeset by MathJax: {math['bad']}"
    assert not raw, f"{toc_page}: raw TeX left in the page: {raw}"
    assert not broken, f"{toc_page}: images that did not load: {broken}"
    assert not overflow, (f"{toc_page}: needs horizontal scrolling at 1280 px (split the equation, "
                          f"shorten the line to about 80 characters): {overflow}")
    assert not problems, f"{toc_page}:\n" + "\n".join(problems)
    assert shot.stat().st_size > 0
