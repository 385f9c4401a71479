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
# The banner in each edition's language (Sphinx's ``language``; English for any other).
NOTICES = {
    "en": NOTICE,
    "zh_CN": ("尚未发布：在本书发布到自己的地址之前，本课程的 Colab、启动和 GitHub 链接都指向占位仓库 "
              "github.com/gpu-memory-wall/course。"),
}


def notice_for(repository_url: str | None, language: str | None = None) -> str | None:
    """The banner's HTML, in ``language``, while ``repository_url`` is the placeholder, else None."""
    url = (repository_url or "").rstrip("/").removesuffix(".git")
    return NOTICES.get(language or "en", NOTICE) if url == PLACEHOLDER_URL else None


def _announce(app: Sphinx, config: Config) -> None:
    options = dict(config.html_theme_options or {})
    notice = notice_for(options.get("repository_url"), config.language)
    if notice and not options.get("announcement"):
        options["announcement"] = notice
        config.html_theme_options = options


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _announce)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
