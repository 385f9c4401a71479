"""Every page of the built book, in both editions, opened in headless Chromium, renders without
errors and offline.

Fails on: console errors and page errors, math left untypeset, images that did not load, failed
requests for the book's own files, any equation or code cell (input or output) wider than its
column at a 1280 px wide window, a page that scrolls sideways there, a line of code that wraps
(the CSS wrap is only a fallback: lab code keeps to 80 columns), nbval's markers shown on the
page, a missing "not yet published" banner while repository.url is the placeholder, and a link
to the other edition's page that is missing or does not load; on the Chinese pages also Chinese
text drawn without a CJK font (blank or as boxes). The search page, in each edition, finds the
pages that teach a term (显存, 梯度累积, 流水线并行 in Chinese). Requests to any other host are
blocked, so a page
that needs the network (for instance MathJax from a CDN) fails. A screenshot of each page's first
screen is saved in the test's tmp_path (the whole page with LABKIT_FULL_SCREENSHOTS=1: painting a
long page costs 1.5-3 s, once a page of each edition, and no check reads the picture).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from browser_support import LOCAL_HOSTS, ROOT, SCALE, other_hosts, patiently, serving


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


# The link to the same page in the other edition (_ext/language_switch.py): its absolute URL,
# whether it is shown, and the HTTP status of what it points to.
LANGUAGE_LINK = """async () => {
  const found = [];
  for (const a of document.querySelectorAll('a.language-switch-link')) {
    const box = a.getBoundingClientRect();
    let status = 0;
    try { status = (await fetch(a.href)).status; } catch (e) { status = -1; }
    found.push({href: a.href, status, visible: box.width > 0 && box.height > 0});
  }
  return found;
}"""

# A few distinct Chinese characters of the page's visible text, drawn on a canvas in the font of
# the element that shows them: without a CJK font they come out blank or as identical boxes.
CJK_GLYPHS = """() => {
  let element = null, chars = [];
  const visit = (root) => {  // the element whose text has the most distinct characters (up to 4)
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n && chars.length < 4; n = walker.nextNode()) {
      const parent = n.parentElement;
      if (!parent || parent.closest('script, style') || !parent.getClientRects().length) continue;
      const found = [...new Set(n.textContent.match(/[\u4e00-\u9fff]/g) || [])];
      if (found.length > chars.length) [element, chars] = [parent, found.slice(0, 6)];
    }
  };
  for (const root of [document.querySelector('main'), document.body]) {
    if (root && chars.length < 4) visit(root);
  }
  if (!element) return null;
  const style = getComputedStyle(element);
  const canvas = document.createElement('canvas');
  canvas.width = canvas.height = 48;
  const ctx = canvas.getContext('2d', {willReadFrequently: true});
  ctx.font = `${style.fontWeight} 32px ${style.fontFamily}`;
  const signatures = chars.map(ch => {
    ctx.clearRect(0, 0, 48, 48);
    ctx.fillText(ch, 4, 38);
    const alpha = ctx.getImageData(0, 0, 48, 48).data.filter((_, i) => i % 4 === 3);
    return alpha.join(',');
  });
  return {text: chars.join(''), family: style.fontFamily,
          distinct: new Set(signatures).size,
          blank: signatures.filter(s => !/[1-9]/.test(s)).length};
}"""


def _open(tab, url: str, name: str, tmp_path: Path, extra: dict[str, str]) -> dict:
    """Open one page at 1280 px in ``tab`` (the worker's tab, browser_support.Tab, whose context
    reaches this machine only), wait for MathJax, and return
    what the checks read from it (and from ``extra``: {key: JavaScript function}), the requests
    blocked and the problems the browser reported."""
    problems: list[str] = []

    def on_console(msg):
        # The browser asks the server root for /favicon.ico by itself; the book has none.
        where = urlsplit(msg.location.get("url", ""))
        if msg.type == "error" and not (where.hostname in LOCAL_HOSTS and where.path == "/favicon.ico"):
            problems.append(f"console error: {msg.text} ({msg.location.get('url', '')})")

    def on_request_failed(req):
        if urlsplit(req.url).hostname in LOCAL_HOSTS:
            problems.append(f"request failed: {req.url} ({req.failure})")

    def on_response(resp):
        if urlsplit(resp.url).hostname in LOCAL_HOSTS and resp.status >= 400:
            problems.append(f"HTTP {resp.status}: {resp.url}")

    with tab.visit() as (page, on):
        blocked = other_hosts(page, problems, on)
        on("console", on_console)
        on("pageerror", lambda err: problems.append(f"page error: {err}"))
        on("requestfailed", on_request_failed)
        on("response", on_response)
        response = patiently(f"{name}: the page did not load",
                             lambda ms: page.goto(url, wait_until="load", timeout=ms), 60)
        assert response is not None and response.ok, f"{url}: HTTP error"

        has_math = page.evaluate("() => document.querySelectorAll('.math').length > 0")
        if has_math:
            patiently(f"{name}: the page has math but MathJax did not start (blocked non-local "
                      f"requests: {blocked})",
                      lambda ms: page.wait_for_function(
                          "() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                          timeout=ms), 30)
            page.evaluate("() => MathJax.startup.promise")
        checks = {"math": FIND_UNTYPESET_MATH, "raw": FIND_RAW_MATH, "broken": FIND_BROKEN_IMAGES,
                  "overflow": FIND_OVERFLOW, "wrapped": FIND_WRAPPED_CODE, "width": PAGE_WIDTH,
                  "nbval": FIND_NBVAL, "banner": BANNER, **extra}
        found = {key: page.evaluate(script) for key, script in checks.items()}
        patiently(f"{name}: the page's requests did not end",
                  lambda ms: page.wait_for_load_state("networkidle", timeout=ms), 30)
        shot = tmp_path / f"{name.replace('/', '__')}.png"
        page.screenshot(path=str(shot), full_page=os.environ.get("LABKIT_FULL_SCREENSHOTS") == "1")
    print(f"{name}: {found['math']['count']} math elements; blocked non-local requests: "
          f"{blocked}; screenshot {shot}")
    assert shot.stat().st_size > 0
    return {**found, "blocked": blocked, "problems": problems}


def _check_common(name: str, found: dict, banner_text: str) -> None:
    """What every page of either edition must satisfy."""
    needed = [u for u in found["blocked"] if "mathjax" in u.lower()]
    assert not needed, f"{name} requests MathJax from the network: {needed}"
    assert not found["math"]["bad"], f"{name}: math not typeset by MathJax: {found['math']['bad']}"
    assert not found["raw"], f"{name}: raw TeX left in the page: {found['raw']}"
    assert not found["broken"], f"{name}: images that did not load: {found['broken']}"
    assert not found["overflow"], (
        f"{name}: needs horizontal scrolling at 1280 px (split the equation, shorten the line to "
        f"about 80 characters): {found['overflow']}")
    width = found["width"]
    assert width["scroll"] <= width["client"] + 1, (
        f"{name} scrolls sideways at 1280 px: {width['scroll']} px wide in {width['client']}")
    assert not found["wrapped"], (f"{name}: code lines that wrap (keep lab code to 80 columns):\n"
                                  + "\n".join(found["wrapped"]))
    assert not found["nbval"], f"{name} shows nbval's markers (use the cell tag): {found['nbval']}"
    banner = found["banner"]
    if PLACEHOLDER:
        assert banner and banner_text in banner, (
            f"{name}: no visible 'not yet published' banner while repository.url is the "
            f"placeholder ({banner!r})")
    else:
        assert banner is None, f"{name} still shows the placeholder banner: {banner!r}"
    assert not found["problems"], f"{name}:\n" + "\n".join(found["problems"])


def _check_language_link(name: str, found: dict, expected_url: str) -> None:
    link = found["language_link"]
    assert len(link) == 1, f"{name}: {len(link)} links to the other edition (one expected)"
    assert link[0]["href"] == expected_url, (
        f"{name}: the language link goes to {link[0]['href']}, not {expected_url}")
    assert link[0]["status"] == 200 and link[0]["visible"], f"{name}: language link {link[0]}"


def test_page_renders_offline(book_tab, site, toc_page, tmp_path):
    found = _open(book_tab, f"{site}/{toc_page}.html", toc_page, tmp_path,
                  {"language_link": LANGUAGE_LINK})
    _check_common(toc_page, found, "Not yet published")
    _check_language_link(toc_page, found, f"{site}/zh/{toc_page}.html")


def test_chinese_page_renders_offline(book_tab, site, toc_page, tmp_path):
    """The same checks on the Chinese edition's page, and: its Chinese text is drawn with real
    glyphs (a CJK font), and its language link leads back to the English page."""
    name = f"zh/{toc_page}"
    found = _open(book_tab, f"{site}/zh/{toc_page}.html", name, tmp_path,
                  {"language_link": LANGUAGE_LINK, "cjk": CJK_GLYPHS})
    _check_common(name, found, "尚未发布")
    _check_language_link(name, found, f"{site}/{toc_page}.html")
    cjk = found["cjk"]
    assert cjk is not None, f"{name}: no Chinese text on the page"
    print(f"{name}: CJK sample {cjk['text']!r} in {cjk['family']}")
    assert cjk["blank"] == 0 and cjk["distinct"] == len(cjk["text"]), (
        f"{name}: Chinese characters {cjk['text']!r} are drawn as blanks or identical boxes in "
        f"{cjk['family']} ({cjk}): no font with CJK glyphs (apt-get install fonts-noto-cjk)")


# Sphinx's search page, once its search has finished: the summary and the pages found.
SEARCH_DONE = r"""() => {
  const summary = document.querySelector('#search-results .search-summary');
  return summary !== null && summary.innerText.trim().length > 0;
}"""
SEARCH_RESULTS = r"""() => Array.from(document.querySelectorAll('#search-results ul.search li a'))
  .map(a => a.getAttribute('href'))"""


@pytest.mark.parametrize("edition, term, page", [
    ("zh/", "显存", "chapters/01_memory_wall"),
    ("zh/", "梯度累积", "chapters/04_accumulation"),
    ("zh/", "流水线并行", "chapters/06_pipeline"),
    ("", "accumulation", "chapters/04_accumulation"),
])
def test_search_finds_the_page(book_tab, site, edition, term, page):
    """The book's search page, in the same browser: a term finds the page that teaches it, in
    both editions (the Chinese one needs jieba and the glossary's words, _ext/i18n_edition.py)."""
    from urllib.parse import quote

    problems: list[str] = []
    with book_tab.visit() as (tab, on):
        outside = other_hosts(tab, problems, on)
        url = f"{site}/{edition}search.html?q={quote(term)}"
        patiently(f"{url} did not load", lambda ms: tab.goto(url, wait_until="load", timeout=ms), 60)
        patiently(f"searching {term!r} did not finish",
                  lambda ms: tab.wait_for_function(SEARCH_DONE, timeout=ms), 30)
        found = tab.evaluate(SEARCH_RESULTS)
    assert not outside and not problems, f"{term!r}: requests outside the book: {outside} {problems}"
    assert any(href.split("?")[0].split("#")[0].endswith(f"{page}.html") for href in found), (
        f"searching {term!r} in {edition or 'the English edition'} does not find {page}: {found}")


def test_no_host_but_this_machine_is_reached(book_tabs, tmp_path):
    """The offline rule holds in the pages' own context: a script served on this machine loads
    from 127.0.0.1, and the same script asked for under another name (book.localhost, which
    Chromium would otherwise resolve to this machine itself) is caught and not loaded."""
    (tmp_path / "x.js").write_text("window.reached = (window.reached || 0) + 1;")
    with serving(tmp_path) as url:
        port = urlsplit(url).port
        tab = book_tabs.new_page()
        problems: list[str] = []
        outside = other_hosts(tab, problems)
        try:
            tab.set_content(f'<script src="http://127.0.0.1:{port}/x.js"></script>'
                            f'<script src="http://book.localhost:{port}/x.js"></script>',
                            wait_until="load", timeout=60_000 * SCALE)
            reached = tab.evaluate("() => window.reached || 0")
        finally:
            tab.close()
    assert reached == 1, f"{reached} of the two scripts ran (only the one from 127.0.0.1 should)"
    assert outside == [f"http://book.localhost:{port}/x.js"] and not problems, (outside, problems)


def test_a_slow_page_gets_one_more_wait_on_a_busy_machine_only(monkeypatch):
    """``patiently``: a Playwright wait that times out is given once more as long when the machine
    is busy, and fails saying so (and naming the knob) if it times out again; on an idle machine it
    fails at once, saying the machine is not busy. ``Deadline`` stretches a polling wait alike."""
    import browser_support
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    def times_out(n):
        calls = []

        def wait(ms):
            calls.append(ms)
            if len(calls) <= n:
                raise PlaywrightTimeout(f"Timeout {ms}ms exceeded.")
            return "loaded"
        return wait, calls

    busy = "this machine is busy (load 9.0 on 2 cores) ... LABKIT_TIMEOUT_SCALE=4"
    monkeypatch.setattr(browser_support, "busy_note", lambda: busy)
    wait, calls = times_out(1)
    assert browser_support.patiently("the page did not load", wait, 2) == "loaded"
    assert calls == [2000 * browser_support.SCALE] * 2
    wait, calls = times_out(2)
    with pytest.raises(pytest.fail.Exception) as failed:
        browser_support.patiently("the page did not load", wait, 2)
    assert len(calls) == 2 and "the page did not load within" in str(failed.value)
    assert "s more: " + busy in str(failed.value)
    deadline = browser_support.Deadline(0.001)
    time.sleep(0.05 * browser_support.SCALE)
    assert not deadline.passed()  # stretched once
    time.sleep(0.05 * browser_support.SCALE)
    assert deadline.passed() and "s more (this machine is busy" in deadline.said()

    monkeypatch.setattr(browser_support, "busy_note", lambda: "")
    wait, calls = times_out(1)
    with pytest.raises(pytest.fail.Exception) as failed:
        browser_support.patiently("the page did not load", wait, 2)
    assert len(calls) == 1 and "(the machine is not busy)" in str(failed.value)
    deadline = browser_support.Deadline(0.001)
    time.sleep(0.05 * browser_support.SCALE)
    assert deadline.passed() and "more" not in deadline.said()


def test_chromium_keeps_playwrights_disabled_features_and_opens_no_omnibox_popup(browser, book_tabs):
    """CHROMIUM_ARGS' --disable-features replaces Playwright's own, so it must repeat what the
    installed Playwright disables (read from its chromiumSwitches); and a page's window holds no
    browser UI page (the omnibox's pop-up, a renderer for each tab) beside the page."""
    import re
    from pathlib import Path

    import playwright
    from browser_support import CHROMIUM_ARGS, NO_OMNIBOX_POPUP

    package = Path(playwright.__file__).parent / "driver" / "package" / "lib"
    lists = [re.search(r"disabledFeatures = \[(.*?)\]", p.read_text(encoding="utf-8"), re.S)
             for p in package.rglob("*.js") if "disabledFeatures = [" in p.read_text(encoding="utf-8")]
    assert lists and all(lists), f"Playwright's list of disabled features not found under {package}"
    playwrights = {name for m in lists for name in re.findall(r'^\s*"(\w+)"', m.group(1), re.M)}
    ours = [a for a in CHROMIUM_ARGS if a.startswith("--disable-features=")]
    assert len(ours) == 1, ours
    missing = playwrights - set(ours[0].split("=", 1)[1].split(","))
    assert len(playwrights) > 5 and not missing, f"add Playwright's {sorted(missing)} to PLAYWRIGHT_DISABLED"
    tab = book_tabs.new_page()
    try:
        tab.set_content("<p>a page</p>")
        targets = browser.new_browser_cdp_session().send("Target.getTargets")["targetInfos"]
    finally:
        tab.close()
    assert not [t["url"] for t in targets if t["type"] != "page"], (NO_OMNIBOX_POPUP, targets)
