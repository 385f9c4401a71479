"""What the browser tests share: Chromium's path and flags, the hosts a page may reach, and how
much longer to wait on a loaded machine. The fixtures that start Chromium and serve the built book
(``browser``, ``book_tabs``, ``book_tab``, ``site``) live in tests/conftest.py, once per session: one
Chromium, one browser context and one tab in it that the page and calculator tests navigate in
turn (``Tab``)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from labkit.busy import busy_note, timeout_scale

# a loaded machine loads pages slowly: every wait below is this many times longer
SCALE = timeout_scale()

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
# The book is read offline: no host but this machine's resolves, so a page that needs the network
# (MathJax from a CDN, a web font) fails to load it. This is the browser's rule, not a Playwright
# route: a route turns off the HTTP cache, and every page would compile MathJax's megabyte of
# JavaScript again (four chapter pages, measured: 20.4 CPU-seconds that way, 13.8 in one context
# with this rule). A request to a host given by its address, which no name rule stops, is caught
# by ``other_hosts``.
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND, " + ", ".join(f"EXCLUDE {h}" for h in sorted(LOCAL_HOSTS))
# Chromium opens its omnibox's pop-up, a WebUI page with a renderer process of its own, for every
# window, and Playwright opens a window for every page: 0.5 CPU-s a tab that no check reads (twelve
# chapter pages, measured: 34.1 CPU-s with it, 26.3 without). A second --disable-features replaces
# the first, so the list repeats Playwright's own (its chromiumSwitches; tests/test_browser.py
# checks that it still holds what the installed Playwright disables).
PLAYWRIGHT_DISABLED = (
    "AvoidUnnecessaryBeforeUnloadCheckSync", "DestroyProfileOnBrowserClose", "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable", "LensOverlay", "MediaRouter", "PaintHolding",
    "ThirdPartyStoragePartitioning", "AvoidCorsURLLoaderRestartOnRedirect", "TcpPortRandomizationWin",
    "OptimizationHints", "NetworkTimeServiceQuerying", "AimEnabled", "PreconnectToSearch",
    "msForceBrowserSignIn", "msEdgeUpdateLaunchServicesPreferredVersion",
)
NO_OMNIBOX_POPUP = ("WebUIOmniboxPopup", "WebUIOmniboxAimPopup")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", OFFLINE,
    "--disable-features=" + ",".join(PLAYWRIGHT_DISABLED + NO_OMNIBOX_POPUP),
]
ROOT = Path(__file__).resolve().parents[1]


def patiently(what: str, wait, seconds: float):
    """``wait(timeout_ms)``, a Playwright wait, given ``seconds`` times SCALE; on a busy machine
    (labkit.busy) once more as long, since a page that loads slowly there is slow, not broken.
    What it returns, or a failure that says ``what`` did not happen, how long it waited and, on a
    busy machine, that this is the likely cause and the knob (LABKIT_TIMEOUT_SCALE)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    limit = seconds * SCALE
    try:
        return wait(limit * 1000)
    except PlaywrightTimeout:
        if not busy_note():
            pytest.fail(f"{what} within {limit:g} s (the machine is not busy)")
    try:
        return wait(limit * 1000)
    except PlaywrightTimeout:
        pytest.fail(f"{what} within {limit:g} s and {limit:g} s more: "
                    f"{busy_note() or 'the machine is no longer busy'}")


class Deadline:
    """A polling wait's limit: ``seconds`` times SCALE, stretched once by as long on a busy
    machine, as ``patiently`` does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds * SCALE
        self.at = time.monotonic() + self.seconds
        self.stretched = False

    def passed(self) -> bool:
        if time.monotonic() <= self.at:
            return False
        if busy_note() and not self.stretched:
            self.at, self.stretched = time.monotonic() + self.seconds, True
            return False
        return True

    def said(self) -> str:
        """How long it waited, and whether a busy machine is the likely cause."""
        waited = f"{self.seconds:g} s" + (f" and {self.seconds:g} s more" if self.stretched else "")
        return f"within {waited} ({busy_note() or 'the machine is not busy'})"


def chromium_or_skip() -> None:
    """Skip (fail under CI=true) when Playwright or Chromium is missing."""
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


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


@contextlib.contextmanager
def serving(folder):
    """Serve ``folder`` on 127.0.0.1 at a port the OS picks (held while serving); yield its URL."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class Tab:
    """One tab of ``context`` that the tests navigate in turn, each to its own page: a new tab
    costs a renderer process and Playwright's set-up of a page, 0.55 CPU-s a page that no check
    reads (twelve chapter pages, measured: 26.3 CPU-s a tab each, 19.6 in one tab navigated;
    scripts/results/suite_times.md). A visit watches the page with handlers of its own and ends on
    about:blank, so that the next test's handlers see nothing of this page; a visit that fails
    closes the tab, and the next one opens another."""

    def __init__(self, context) -> None:
        self.context, self.page = context, None

    @contextlib.contextmanager
    def visit(self):
        """Yield ``(page, on)``: ``on(event, handler)`` is ``page.on`` for this visit only."""
        from playwright.sync_api import Error as PlaywrightError

        if self.page is None or self.page.is_closed():
            self.page = self.context.new_page()
        page, handlers, ended = self.page, [], False

        def on(event: str, handler) -> None:
            page.on(event, handler)
            handlers.append((event, handler))

        try:
            yield page, on
            try:
                page.goto("about:blank", timeout=30_000 * SCALE)
                ended = True
            except PlaywrightError:
                pass  # a tab that cannot leave its page is closed below
        finally:
            for event, handler in handlers:
                page.remove_listener(event, handler)
            if not ended:
                page.close()
                self.page = None


def other_hosts(page, problems: list[str], on=None) -> list[str]:
    """Watch ``page`` (through ``on``, a visit's, or ``page.on``): the list it returns fills with
    every request the page makes to a host other than this machine (each fails: see OFFLINE);
    were one answered, ``problems`` says so."""
    found: list[str] = []
    on = on or page.on

    def on_request(request) -> None:
        if urlsplit(request.url).hostname not in LOCAL_HOSTS and request.url.startswith("http"):
            found.append(request.url)

    def on_response(response) -> None:
        if urlsplit(response.url).hostname not in LOCAL_HOSTS and response.url.startswith("http"):
            problems.append(f"answered from outside this machine (not blocked): {response.url}")

    on("request", on_request)
    on("response", on_response)
    return found
