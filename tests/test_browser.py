"""Every page of the built book, opened in headless Chromium, renders without errors and offline.

Fails on: console errors and page errors, math left untypeset, images that did not load, failed
requests for the book's own files, any equation or code cell (input or output) wider than its
column at a 1280 px wide window, a page that scrolls sideways there, a line of code that wraps
(the CSS wrap is only a fallback: lab code keeps to 80 columns), nbval's markers shown on the
page, and a missing "not yet published" banner while repository.url is the placeholder. Requests to any other host are blocked, so a page
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
ROOT = Path(__file__).resolve().parents[1]


def _placeholder_in_use() -> bool:
    """Whether _config.yml's repository.url is still the placeholder the banner announces."""
    import importlib.util

    import yaml

    spec = importlib.util.spec_from_file_location("placeholder_notice",
                                                  ROOT / "_ext" / "placeholder_notice.py")
    notice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(notice)
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return notice.notice_for(config["repository"]["url"]) is not None


PLACEHOLDER = _placeholder_in_use()

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

# Lines of code that the browser breaks over more than one line: each line's text is measured
# with a Range, whose rectangles lie on more than one line box if it wrapped. Printed output (a
# cell's output, a ```text block such as GPU_RESULTS.md's records) may wrap: it is not code.
FIND_WRAPPED_CODE = """() => {
  const found = [];
  for (const pre of document.querySelectorAll('div.highlight pre')) {
    if (pre.clientWidth === 0) continue;
    if (pre.closest('.cell_output, .highlight-text, .highlight-none')) continue;
    const nodes = [];
    let text = '';
    const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      nodes.push([n, text.length]);
      text += n.textContent;
    }
    const at = (offset) => {
      let k = nodes.length - 1;
      while (k > 0 && nodes[k][1] > offset) k--;
      return [nodes[k][0], offset - nodes[k][1]];
    };
    let start = 0;
    for (const line of text.split('\\n')) {
      const end = start + line.length;
      if (line.trim() && nodes.length) {
        const range = document.createRange();
        range.setStart(...at(start));
        range.setEnd(...at(end));
        const tops = new Set(Array.from(range.getClientRects())
          .filter(r => r.width > 0).map(r => Math.round(r.top)));
        if (tops.size > 1) found.push(`${line.length} chars: ${line.trim().slice(0, 100)}`);
      }
      start = end + 1;
    }
  }
  return found;
}"""

# The page itself wider than the window (it would scroll sideways).
PAGE_WIDTH = """() => ({scroll: document.documentElement.scrollWidth,
               client: document.documentElement.clientWidth})"""

# Visible lines of text that show nbval's markers.
FIND_NBVAL = """() => document.body.innerText.split('\\n')
  .filter(line => line.includes('NBVAL')).map(line => line.trim().slice(0, 100))"""

# The theme's announcement banner, if shown.
BANNER = """() => {
  const el = document.querySelector('.bd-header-announcement');
  if (!el) return null;
  const box = el.getBoundingClientRect();
  return box.width > 0 && box.height > 0 ? el.innerText.trim() : null;
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
        wrapped = page.evaluate(FIND_WRAPPED_CODE)
        width = page.evaluate(PAGE_WIDTH)
        nbval = page.evaluate(FIND_NBVAL)
        banner = page.evaluate(BANNER)
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
    assert width["scroll"] <= width["client"] + 1, (
        f"{toc_page} scrolls sideways at 1280 px: {width['scroll']} px wide in {width['client']}")
    assert not wrapped, (f"{toc_page}: code lines that wrap (keep lab code to 80 columns):\n"
                         + "\n".join(wrapped))
    assert not nbval, f"{toc_page} shows nbval's markers (use the cell tag): {nbval}"
    if PLACEHOLDER:
        assert banner and "Not yet published" in banner, (
            f"{toc_page}: no visible 'not yet published' banner while repository.url is the "
            f"placeholder ({banner!r})")
    else:
        assert banner is None, f"{toc_page} still shows the placeholder banner: {banner!r}"
    assert not problems, f"{toc_page}:\n" + "\n".join(problems)
    assert shot.stat().st_size > 0
