"""Sphinx extension: a link on every page to the same page in the book's other edition.

The English book is built into ``_build/html`` and the Chinese one into ``_build/html/zh``
(``scripts/build_book.py``). Each page gets, above its title, a link to its twin in the other
edition, and a ``<link rel="alternate" hreflang>`` for search engines. The links are relative,
so they work when the pages are opened as files (``file://``) as well as from a server.
"""

from __future__ import annotations

import html
import posixpath
from pathlib import Path

from sphinx.application import Sphinx

STATIC = Path(__file__).resolve().parent / "static"
# Each edition: its Sphinx language, the folder it is built into under the English output, the
# link's label (in the edition's own language) and its BCP 47 tag. scripts/build_book.py builds
# these editions into these folders.
EDITIONS = (
    {"language": "en", "folder": "", "label": "English", "tag": "en"},
    {"language": "zh_CN", "folder": "zh", "label": "中文", "tag": "zh-CN"},
)


def edition_of(language: str | None) -> dict:
    """The edition built with Sphinx's ``language`` (English when it is unset)."""
    for edition in EDITIONS:
        if edition["language"] == (language or "en"):
            return edition
    raise ValueError(f"language={language!r} is not one of the book's editions: "
                     f"{[e['language'] for e in EDITIONS]}")


def other_editions(language: str | None) -> list[dict]:
    this = edition_of(language)
    return [e for e in EDITIONS if e is not this]


def twin_url(target_uri: str, language: str | None, other: dict) -> str:
    """Relative URL, from the page whose own URI is ``target_uri`` (e.g. "chapters/02_zero.html")
    in the edition of ``language``, to the same page in the edition ``other``."""
    this = edition_of(language)
    depth = target_uri.count("/") + (this["folder"].count("/") + 1 if this["folder"] else 0)
    path = posixpath.join(other["folder"], target_uri) if other["folder"] else target_uri
    return "../" * depth + path


def links_html(target_uri: str, language: str | None) -> str:
    """The visible links of one page (one per other edition)."""
    items = [f'<a class="language-switch-link" '
             f'href="{html.escape(twin_url(target_uri, language, e))}" '
             f'hreflang="{e["tag"]}" lang="{e["tag"]}">{html.escape(e["label"])}</a>'
             for e in other_editions(language)]
    return f'<div class="language-switch">{" ".join(items)}</div>\n'


def _add_links(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if app.builder.format != "html" or doctree is None:
        return
    target = app.builder.get_target_uri(pagename)
    language = app.config.language
    context["body"] = links_html(target, language) + context.get("body", "")
    alternates = "".join(
        f'<link rel="alternate" hreflang="{e["tag"]}" '
        f'href="{html.escape(twin_url(target, language, e))}" />\n'
        for e in other_editions(language))
    context["metatags"] = context.get("metatags", "") + alternates


def _add_static(app: Sphinx) -> None:
    if str(STATIC) not in app.config.html_static_path:
        app.config.html_static_path.append(str(STATIC))


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", _add_static)
    app.connect("html-page-context", _add_links)
    app.add_css_file("language_switch.css")
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
