"""What the browser tests share: Chromium's path and flags, the hosts a page may reach, and how
much longer to wait on a loaded machine. The fixtures that start Chromium and serve the built book
(``browser``, ``site``) live in tests/conftest.py, once per session: one Chromium for the pages and
the calculators."""

from __future__ import annotations

import http.server
import os
from pathlib import Path

import pytest

from labkit.busy import timeout_scale

# a loaded machine loads pages slowly: every wait below is this many times longer
SCALE = timeout_scale()

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
ROOT = Path(__file__).resolve().parents[1]


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
