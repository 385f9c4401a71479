"""Sphinx extension: the book's layout rules for code cells (see static/code_layout.css).

Outputs wrap their long lines, and the code font is sized so that an 80-character lab line fits
the column at a 1280 px wide window: nothing needs horizontal scrolling.
"""

from __future__ import annotations

from pathlib import Path

from sphinx.application import Sphinx

STATIC = Path(__file__).resolve().parent / "static"


def _add_static(app: Sphinx) -> None:
    if str(STATIC) not in app.config.html_static_path:
        app.config.html_static_path.append(str(STATIC))


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", _add_static)
    app.add_css_file("code_layout.css")
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
