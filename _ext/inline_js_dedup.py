"""Sphinx extension: stop inline scripts from being written twice into every page.

Sphinx 7.4 keeps an inline script that an extension adds after the builder started (as
sphinx-thebe does with ``const THEBE_JS_URL = ...``) under the file name ``None``, then adds it
again as ``''`` before writing: each page gets the script twice and the browser reports
"Identifier 'THEBE_JS_URL' has already been declared". This drops the first copy.
"""

from __future__ import annotations

from sphinx.application import Sphinx


def _drop_duplicates(app: Sphinx, env) -> None:
    js_files = getattr(app.builder, "_js_files", None)
    if js_files is None:
        return
    # Inline scripts the registry holds; the builder re-adds each of them before writing.
    registered = {attrs.get("body") for name, attrs in app.registry.js_files if not name}
    js_files[:] = [js for js in js_files
                   if not (js.filename is None and js.attributes.get("body") in registered)]


def setup(app: Sphinx) -> dict:
    app.connect("env-updated", _drop_duplicates)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
