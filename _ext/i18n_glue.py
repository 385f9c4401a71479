"""Sphinx extension: a lab's glued numbers keep working in its translated paragraphs.

In a notebook, ``{glue:text}`key``` reads the key from the notebook being parsed; myst-nb holds
that notebook's glue data only while it parses it. Sphinx parses a translated paragraph (from the
gettext catalogue) later, on its own, so the same role would find no glue data and the Chinese
page would fail to build. Here such a role, met outside the notebook's own parse, reads the key
from the notebook's stored glue data instead, as ``{glue:text}`this_lab.ipynb::key``` would:
the number shown is the same one in both editions.
"""

from __future__ import annotations

from pathlib import Path

from sphinx.application import Sphinx


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
        return run(self)

    wrapped._own_notebook = True
    role_class.run = wrapped


def setup(app: Sphinx) -> dict:
    from myst_nb.ext.glue import roles

    _patch(roles.PasteRoleAny, with_format=False)
    _patch(roles.PasteTextRole, with_format=True)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
