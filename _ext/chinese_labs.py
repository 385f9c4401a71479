"""Sphinx extension: a Chinese lab page's Colab and download buttons open the Chinese notebook.

sphinx-book-theme points a notebook page's launch buttons (Colab, ...) at the page's source in
the repository, ``labs/NN_name.ipynb``, and its download button at that source copied into
``_sources``. In a translated edition, when ``labs/<folder>/NN_name.ipynb`` exists (the lab with
its Markdown from the catalogue: scripts/zh_labs.py), both point at it instead, and the notebook
is copied into ``_sources`` beside the English one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sphinx.application import Sphinx

FOLDERS = {"zh_CN": "zh"}  # the Chinese labs' folder under labs/, per Sphinx language


def chinese_notebook(app: Sphinx, pagename: str) -> Path | None:
    """The translated notebook of lab page ``pagename`` in this edition's language, if any."""
    folder = FOLDERS.get(app.config.language or "en")
    if folder is None or not pagename.startswith("labs/") or pagename.count("/") != 1:
        return None
    path = Path(app.srcdir) / "labs" / folder / f"{pagename.split('/')[1]}.ipynb"
    return path if path.is_file() else None


def _rewrite(buttons, old: str, new: str) -> int:
    """Replace ``old`` by ``new`` in every button's url (nested dropdowns too); how many."""
    count = 0
    for button in buttons or []:
        if isinstance(button.get("url"), str) and old in button["url"]:
            button["url"] = button["url"].replace(old, new)
            count += 1
        count += _rewrite(button.get("buttons"), old, new)
    return count


def point_at_chinese_lab(app: Sphinx, pagename, templatename, context, doctree) -> None:
    notebook = chinese_notebook(app, pagename)
    if notebook is None:
        return
    english = f"{pagename}.ipynb"
    chinese = f"labs/{notebook.parent.name}/{notebook.name}"
    if _rewrite(context.get("header_buttons"), english, chinese):
        target = Path(app.outdir) / "_sources" / chinese
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(notebook, target)


def setup(app: Sphinx) -> dict:
    # after sphinx-book-theme made the buttons (priority 501)
    app.connect("html-page-context", point_at_chinese_lab, priority=600)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
