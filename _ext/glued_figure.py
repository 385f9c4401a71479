"""Sphinx extension: a numbered figure, in a chapter, around a figure a lab glued.

myst-nb's ``{glue:figure}`` reads a key of its own notebook only, and ``{glue}`` with ``:doc:``
reads one from a lab but makes no figure, so it gets no number and ``{numref}`` cannot name it.
This directive makes the figure at read time (numbered like any other) and lets myst-nb put the
lab's image into it when it resolves the reference::

    ```{glued-figure} fa_tiles_fig
    :doc: ../labs/07_flash_attention.ipynb
    :name: fig-fa-tiles

    The caption: one paragraph.
    ```

In the Chinese edition it shows the lab's Chinese figure, ``fa_tiles_fig_zh``, where the lab drew
one (``labkit.book.glue_figure``; _ext/i18n_glue.py).

myst-nb points such a figure at ``_images/<sha256>.png`` and leaves the file to the lab's own page,
which holds only the figures the lab displays: the Chinese twin, glued but never displayed, would
be missing. ``WriteGluedImages`` writes each glued image a page shows into ``_images``.
"""

from __future__ import annotations

import hashlib
from binascii import a2b_base64
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from myst_nb.ext.glue.utils import PendingGlueReferenceError, create_pending_glue_ref
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util.docutils import SphinxDirective

from i18n_glue import chinese_key


class GluedFigure(SphinxDirective):
    """``{glued-figure} key`` with ``:doc:`` (the lab), ``:name:`` and a one-paragraph caption."""

    required_arguments = 1
    final_argument_whitespace = True
    has_content = True
    option_spec = {"doc": directives.unchanged_required, "name": directives.unchanged,
                   "width": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        if "doc" not in self.options:
            raise self.error("glued-figure needs :doc:, the lab that glued the figure")
        source, line = self.get_source_info()
        try:
            image = create_pending_glue_ref(self.state.document, source, line,
                                            self.options["doc"],
                                            chinese_key(self.env, self.options["doc"],
                                                        self.arguments[0]))
        except PendingGlueReferenceError as exc:
            raise self.error(str(exc)) from exc
        holder = nodes.Element()
        self.state.nested_parse(self.content, self.content_offset, holder)
        if len(holder.children) != 1 or not isinstance(holder[0], nodes.paragraph):
            raise self.error("glued-figure's content must be one paragraph: the caption")
        caption = nodes.caption(holder[0].rawsource, "", *holder[0].children)
        # a source and a line make the caption translatable (Sphinx's gettext and the Chinese
        # edition skip text nodes without them)
        caption.source, caption.line = holder[0].source or source, holder[0].line or line
        figure = nodes.figure("", image, caption)
        if "width" in self.options:
            figure["width"] = self.options["width"]
        self.set_source_info(figure)
        self.add_name(figure)
        return [figure]


class WriteGluedImages(SphinxPostTransform):
    """Before myst-nb resolves a page's glue references to other documents (its priority 5),
    write each glued PNG they show where myst-nb's image node will point: _images/<sha256>.png."""

    default_priority = 4

    def run(self, **kwargs) -> None:
        from myst_nb.ext.glue.crossref import read_glue_cache
        from myst_nb.ext.glue.utils import PendingGlueReference

        builder = self.app.builder
        if not getattr(builder, "imagedir", ""):
            return
        for node in self.document.findall(PendingGlueReference):
            glued = read_glue_cache(self.env.mystnb_config.output_folder, node.refdoc)
            png = glued.get(node.key, {}).get("data", {}).get("image/png")
            if node.gtype == "text" or not png:
                continue
            data = a2b_base64(png)
            path = Path(builder.outdir) / builder.imagedir / f"{hashlib.sha256(data).hexdigest()}.png"
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)


def setup(app: Sphinx) -> dict:
    app.add_directive("glued-figure", GluedFigure)
    app.add_post_transform(WriteGluedImages)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
