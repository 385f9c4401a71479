"""What a lab needs from the book that it is part of: ``glue``, which hands a number to a chapter.

When the book is built, :func:`myst_nb.glue` stores the value in the notebook's outputs for the
chapter's ``{glue}`` roles; anywhere else (Colab, a plain Jupyter) the call does nothing.
"""

from __future__ import annotations

from .validate import check_bool

__all__ = ["glue"]


def glue(name: str, value, display: bool = True):
    """``myst_nb.glue(name, value, display)`` when myst-nb is installed; nothing otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} must be a non-empty str (the key a chapter's {{glue}} uses)")
    check_bool("display", display)
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        return None
    return myst_glue(name, value, display=display)
