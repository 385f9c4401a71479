"""Sphinx extension: a link to a file of this repository that is also a page of the book goes to
the page.

Labs and chapters link to files such as GPU_RESULTS.md by their GitHub address, which works on
GitHub and Colab; in the built book the same link should open the book's own page (and work
offline and before the course is published). Links of the form
``{repository.url}/blob/{repository.branch}/PATH`` whose PATH, without its suffix, is a page of the
book are rewritten to that page.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from docutils import nodes
from sphinx.application import Sphinx


def page_for(uri: str, repository_url: str, branch: str, docnames: set[str]) -> str | None:
    """The docname a GitHub link to this repository's file names, or None."""
    prefix = f"{repository_url.rstrip('/')}/blob/{branch}/"
    if not repository_url or not uri.startswith(prefix):
        return None
    path = PurePosixPath(uri[len(prefix):].split("#")[0])
    docname = str(path.with_suffix("")) if path.suffix in (".md", ".ipynb") else None
    return docname if docname in docnames else None


def _rewrite(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    options = app.config.html_theme_options or {}
    url, branch = options.get("repository_url", ""), options.get("repository_branch", "main")
    for ref in doctree.findall(nodes.reference):
        target = page_for(ref.get("refuri", ""), url, branch, app.env.found_docs)
        if target is not None:
            ref["refuri"] = app.builder.get_relative_uri(docname, target)
            ref["internal"] = True


def setup(app: Sphinx) -> dict:
    app.connect("doctree-resolved", _rewrite)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
