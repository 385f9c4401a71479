"""Sphinx extension: what a translated edition would otherwise show in English.

- Table cells. myst-parser gives a table cell's paragraph no source, and Sphinx translates (and
  its gettext builder extracts) only text that has one: every table of a Chinese page stayed
  English. Here the cells get their table's source before Sphinx's translation step, so they are
  messages of the page's catalogue like any paragraph.
- Sidebar captions ("Chapters", "Exercises", "Back matter"). sphinx-external-toc inserts the
  toctrees after Sphinx's translation step; their captions are translated here, from the catalogue
  of the page that holds them (the root page's, where the gettext builder puts them).
- The book's title (the logo's and the suffix of every page's <title>): ``html_title`` is
  translated from the root page's catalogue, whose first heading is the book's title.
- Equation references read "式 (2.3)" in Chinese (``EQREF_FORMAT``).
- Chinese search. Sphinx splits Chinese text into words with jieba (requirements-book.txt); the
  glossary's Chinese terms (locales/<language>/GLOSSARY.md) are its user dictionary, so that
  梯度累积 and 流水线并行 are indexed as the words a reader searches for.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.locale import init as init_locale
from sphinx.transforms import SphinxTransform
from sphinx.util.i18n import docname_to_domain

# Sphinx's math_eqref_format for each translated edition (the English one is in _config.yml).
EQREF_FORMAT = {"zh_CN": "式 ({number})"}


def _translated(app: Sphinx) -> bool:
    return (app.config.language or "en") != "en"


def catalogue(app: Sphinx, docname: str):
    """The gettext catalogue of a page in the edition's language (a NullTranslations if none)."""
    dirs = [str(Path(app.srcdir) / d) for d in app.config.locale_dirs]
    domain = docname_to_domain(docname, app.config.gettext_compact)
    translations, _ = init_locale(dirs, app.config.language, domain)
    return translations


class TableCellSource(SphinxTransform):
    """Give each table cell's paragraph its table's source and line (see the module's note)."""

    default_priority = 15  # before sphinx.transforms.i18n.Locale (20)

    def apply(self, **kwargs) -> None:
        for entry in self.document.findall(nodes.entry):
            for para in entry.findall(nodes.paragraph):
                if para.source:
                    continue
                owner = next((n for n in _ancestors(para) if n.source), self.document)
                para.source = owner.source or self.document.get("source")
                para.line = owner.line


def _ancestors(node: nodes.Node):
    while node.parent is not None:
        node = node.parent
        yield node


class TocCaptions(SphinxTransform):
    """Translate the captions of the toctrees sphinx-external-toc inserts (priority 100)."""

    default_priority = 110

    def apply(self, **kwargs) -> None:
        if not _translated(self.app):
            return
        toctrees = [t for t in self.document.findall(addnodes.toctree) if t.get("caption")]
        if toctrees:
            translations = catalogue(self.app, self.env.docname)
            for toctree in toctrees:
                toctree["caption"] = translations.gettext(toctree["caption"])


def _title(app: Sphinx, env, docnames) -> None:
    """html_title from the root page's catalogue (the .mo files exist once reading starts)."""
    if _translated(app) and app.config.html_title:
        app.config.html_title = catalogue(app, app.config.root_doc).gettext(
            app.config.html_title)


def _glossary_terms(srcdir: Path, language: str) -> list[str]:
    """The Chinese terms of the glossary's table (scripts/i18n.py reads it; loaded by path)."""
    path = srcdir / "locales" / language / "GLOSSARY.md"
    script = srcdir / "scripts" / "i18n.py"
    if not (path.is_file() and script.is_file()):
        return []
    module = sys.modules.get("i18n_script")
    if module is None:  # registered first: its dataclasses look themselves up there
        spec = importlib.util.spec_from_file_location("i18n_script", script)
        module = sys.modules["i18n_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sorted(set(module.glossary(path).values()))


def _configure(app: Sphinx, config) -> None:
    language = config.language or "en"
    if language in EQREF_FORMAT:
        config.math_eqref_format = EQREF_FORMAT[language]
    if language.startswith("zh"):
        terms = [t for t in _glossary_terms(Path(app.srcdir), language) if " " not in t]
        words = Path(app.doctreedir) / "search_words.txt"
        words.parent.mkdir(parents=True, exist_ok=True)
        words.write_text("".join(f"{t} 100000\n" for t in terms), encoding="utf-8")
        config.html_search_options = {**(config.html_search_options or {}), "dict": str(words)}


def setup(app: Sphinx) -> dict:
    app.add_transform(TableCellSource)
    app.add_transform(TocCaptions)
    app.connect("config-inited", _configure)
    app.connect("env-before-read-docs", _title)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
