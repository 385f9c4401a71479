"""Sphinx extension: a lab's glued numbers keep working in its translated paragraphs.

In a notebook, ``{glue:text}`key``` reads the key from the notebook being parsed; myst-nb holds
that notebook's glue data only while it parses it. Sphinx parses a translated paragraph (from the
gettext catalogue) later, on its own, so the same role would find no glue data and the Chinese
page would fail to build. Here such a role, met outside the notebook's own parse, reads the key
from the notebook's stored glue data instead, as ``{glue:text}`this_lab.ipynb::key``` would:
the number shown is the same one in both editions.

Words and figures come in the page's language: a lab glues them twice, ``key`` in English and
``key_zh`` in Chinese (``labkit.book.glue(name, english, zh=chinese)``, ``glue_figure``). In the
Chinese edition every glue role and ``{glued-figure}`` (_ext/glued_figure.py) that names ``key``
of a lab that glued ``key_zh`` reads ``key_zh`` instead; a number has no twin and is read as is.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from sphinx.application import Sphinx

ZH_SUFFIX = "_zh"  # labkit.book.ZH_SUFFIX (the book's extensions do not import labkit)


@functools.lru_cache(maxsize=None)
def _glued_keys(notebook: str, mtime: float) -> frozenset[str]:
    """The glue keys stored in a notebook's outputs."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8")).get("cells", [])
    return frozenset(output.get("metadata", {}).get("scrapbook", {}).get("name")
                     for cell in cells for output in cell.get("outputs", [])) - {None}


def chinese_key(env, doc: str, key: str) -> str:
    """``key``, or its Chinese twin when the page is built in Chinese and the notebook ``doc``
    (relative to the page being read) glued one."""
    if not str(env.config.language or "").startswith("zh"):
        return key
    _, path = env.relfn2path(doc, env.docname)
    path = Path(path)
    if path.suffix != ".ipynb" or not path.is_file():
        return key
    twin = key + ZH_SUFFIX
    return twin if twin in _glued_keys(str(path), path.stat().st_mtime) else key


def in_page_language(text: str, document, with_format: bool = False) -> str:
    """``text`` of a glue role (``doc::key`` or ``doc::key:format``) with the key's Chinese twin
    in the Chinese edition (see :func:`chinese_key`)."""
    env = getattr(getattr(document, "settings", None), "env", None)
    if env is None or env.docname is None or "::" not in text:
        return text
    doc, rest = text.rsplit("::", 1)
    key, sep, fmt = rest.partition(":") if with_format else (rest, "", "")
    return f"{doc}::{chinese_key(env, doc, key.strip())}{sep}{fmt}"


def own_notebook_text(text: str, document, with_format: bool = False) -> str:
    """``text`` of a glue role, with this notebook's file name put in front of a bare key when
    the role is parsed outside the notebook's own parse (a translated message). With
    ``with_format`` (``{glue:text}``, whose ``path::key`` form needs a format) a missing format
    becomes ``:s``, the role's default."""
    settings = getattr(document, "settings", None)
    env = getattr(settings, "env", None)
    if "::" in text or "nb_renderer" in document or env is None or env.docname is None:
        return text
    source = Path(env.doc2path(env.docname))
    if source.suffix != ".ipynb":
        return text
    if with_format and ":" not in text:
        text += ":s"
    return f"{source.name}::{text}"


def _patch(role_class, with_format: bool) -> None:
    run = role_class.run
    if getattr(run, "_own_notebook", False):
        return

    def wrapped(self):
        self.text = own_notebook_text(self.text, self.document, with_format)
        self.text = in_page_language(self.text, self.document, with_format)
        return run(self)

    wrapped._own_notebook = True
    role_class.run = wrapped


def setup(app: Sphinx) -> dict:
    from myst_nb.ext.glue import roles

    _patch(roles.PasteRoleAny, with_format=False)
    _patch(roles.PasteTextRole, with_format=True)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
