"""Sphinx extension: serve MathJax 3 from the book itself instead of a CDN.

The pages load ``_static/mathjax/tex-mml-chtml.js`` (``mathjax_path`` in _config.yml). This
extension copies that file, and the components it loads lazily, from the django-static-mathjax
package into the HTML output, so the book typesets its math with no network access.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

ENTRY = "tex-mml-chtml.js"
# Loaded on demand by the entry point: TeX extensions, CHTML fonts, the menu, accessibility.
COMPONENT_DIRS = ("a11y", "adaptors", "input", "output/chtml", "sre", "ui")


def mathjax_es5() -> Path:
    """Return the ``es5`` folder of MathJax 3 shipped by django-static-mathjax."""
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise ExtensionError("MathJax not found: pip install django-static-mathjax "
                             "(see requirements.txt)")
    es5 = Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax" / "es5"
    if not (es5 / ENTRY).is_file():
        raise ExtensionError(f"{es5 / ENTRY} is missing: django-static-mathjax 3.x is needed")
    return es5


def copy_mathjax(dest: Path) -> None:
    """Copy the MathJax entry point and its components into ``dest`` (once per source)."""
    src = mathjax_es5()
    stamp = dest / ".source"
    if stamp.is_file() and stamp.read_text() == str(src) and (dest / ENTRY).is_file():
        return
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copy2(src / ENTRY, dest / ENTRY)
    for sub in COMPONENT_DIRS:
        shutil.copytree(src / sub, dest / sub)
    if (src.parent / "LICENSE").is_file():
        shutil.copy2(src.parent / "LICENSE", dest / "LICENSE")
    stamp.write_text(str(src))


def _check(app: Sphinx) -> None:
    if app.builder.format == "html":
        path = app.config.mathjax_path
        if "://" in path or path.startswith("/"):
            raise ExtensionError(f"mathjax_path={path!r} must be a local path under _static "
                                 f"(e.g. 'mathjax/{ENTRY}') for the book to work offline")
        mathjax_es5()  # fail early, before any page is written


def _copy(app: Sphinx, exception: Exception | None) -> None:
    if exception is None and app.builder.format == "html":
        copy_mathjax(Path(app.outdir) / "_static" / "mathjax")


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", _check)
    app.connect("build-finished", _copy)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
