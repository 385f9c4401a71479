"""Sphinx extension: say on every page that the course is not published yet.

While ``repository.url`` in _config.yml is the placeholder address below, every Colab link, the
launch and GitHub buttons and the labs' install cells lead nowhere useful; the theme's
announcement banner says so at the top of each page. ``scripts/set_repo_url.py`` writes the real
address into that setting, and the next build drops the banner.
"""

from __future__ import annotations

from sphinx.application import Sphinx
from sphinx.config import Config

PLACEHOLDER_URL = "https://github.com/gpu-memory-wall/course"
NOTICE = ("Not yet published: this course's Colab, launch and GitHub links point to the "
          "placeholder repository github.com/gpu-memory-wall/course until the book is published "
          "at its own address.")


def notice_for(repository_url: str | None) -> str | None:
    """The banner's HTML while ``repository_url`` is the placeholder, else None."""
    url = (repository_url or "").rstrip("/").removesuffix(".git")
    return NOTICE if url == PLACEHOLDER_URL else None


def _announce(app: Sphinx, config: Config) -> None:
    options = dict(config.html_theme_options or {})
    notice = notice_for(options.get("repository_url"))
    if notice and not options.get("announcement"):
        options["announcement"] = notice
        config.html_theme_options = options


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _announce)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
