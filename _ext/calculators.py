"""Sphinx extension: calculators in the pages that run labkit's own Python, offline.

``{calculator} training`` (or ``zero``, ``activations``, ``parallel``, ``kv``, ``plans``) writes
a ``<div class="labkit-calc">``; in the browser, Brython (PyPI ``brython``: a Python interpreter
written in JavaScript, with its standard library) runs ``browser/calculator_ui.py``, which calls
``labkit.estimate`` (and ``labkit.plan``): the same source files the tests check, not a
JavaScript copy of the formulas.
JavaScript only starts Brython and says so in the page if it could not.

At build time this copies brython.js and brython_stdlib.js from the installed package into
``_static/calculators/`` and writes ``labkit.brython.js``: the torch-free labkit modules the
calculators import (found by reading their module-level imports, not by importing them: the build
runs without torch and without labkit installed) and ``calculator_ui.py``, as one Brython package
file. A script file, not modules fetched one by one, so the page works from ``file://``.
Options: ``:preset:`` (default llama-2-7b) and any knob's default, e.g. ``:gpu: h100-sxm``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import sys
from html import escape
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
UI = HERE / "browser" / "calculator_ui.py"  # runs in the page, never in the build
STATIC = "calculators"  # under _static
RUNTIME = ("brython.js", "brython_stdlib.js")
ENTRIES = ("labkit.estimate", "labkit.hardware", "labkit.shapes", "labkit.memory.analytic",
           "labkit.messages")  # messages: the words the calculators show, per page language
KINDS = ("training", "zero", "activations", "parallel", "kv", "plans")
PLANNER = "labkit.plan"  # bundled when the source has it; the "plans" calculator needs it
KNOBS = ("gpu", "seq_len", "micro_batch", "dp_size", "tp_size", "pp_size", "zero_stage",
         "recompute", "sequence_parallel", "precision", "optimizer", "weight_bytes", "kv_bytes",
         "context_len", "gpu_memory_utilization", "num_gpus", "gpus_per_node", "global_batch",
         "micro_batches", "interleave")

# What the page says before Python has loaded, and if it cannot load, by Sphinx ``language``
# (another edition adds its own entry; the words the calculators show once loaded are
# labkit/messages' catalogues, which the bundle carries).
LOADING = {"en": ("Loading the calculator: it runs the course's Python (labkit) in this page. If "
                  "this message stays, the calculator could not load (it needs JavaScript)."),
           "zh_CN": "正在加载计算器：它在本页中运行课程的 Python 代码（labkit）。如果这条消息一直不消失，"
                    "说明计算器未能加载（它需要 JavaScript）。"}
NOT_LOADED = {"en": ("The calculator could not load: its Python runtime (_static/calculators/"
                     "brython.js) is missing from this copy of the book."),
              "zh_CN": "计算器未能加载：本书的这份副本中缺少它的 Python 运行时（_static/calculators/brython.js）。"}
# Shown by JavaScript when the Python runtime did not load at all.
NOT_LOADED_JS = """window.addEventListener('load', function () {
  if (typeof __BRYTHON__ !== 'undefined') return;
  document.querySelectorAll('.labkit-calc-status').forEach(function (el) {
    el.textContent = el.dataset.notLoaded;
  });
});"""


def words(table: dict, language: str | None) -> str:
    """The entry of ``table`` for ``language`` ("zh_CN", then "zh"), else English."""
    language = language or "en"
    return table.get(language) or table.get(language.split("_")[0]) or table["en"]


def _module_file(name: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _top_level_imports(tree: ast.Module, name: str, is_package: bool, root: Path) -> set[str]:
    """Modules imported when the module runs (not those imported inside functions)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}", root))
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def labkit_modules(root: Path = ROOT, entries=ENTRIES) -> dict[str, Path]:
    """The labkit modules that importing ``entries`` runs, with their parent packages; an
    ExtensionError if one of them imports something outside labkit and the standard library."""
    found: dict[str, Path] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(name, root)
        if path is None:
            raise ExtensionError(f"calculators: {name} not found under {root}")
        found[name] = path
        if "." in name:
            todo.append(name.rpartition(".")[0])
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for mod in _top_level_imports(tree, name, path.name == "__init__.py", root):
            top = mod.split(".")[0]
            if top == "labkit":
                todo.append(mod)
            elif top not in sys.stdlib_module_names and top != "__future__":
                raise ExtensionError(f"calculators: {name} imports {mod} when it loads; the "
                                     "calculators run only torch-free, standard-library labkit "
                                     "modules in the browser")
    return found


def entries_for(root: Path) -> tuple[str, ...]:
    return ENTRIES + ((PLANNER,) if _module_file(PLANNER, root) else ())


def bundle(root: Path = ROOT, entries=None) -> str:
    """labkit's modules and the calculators' page code as one Brython package script."""
    vfs: dict = {"$timestamp": 0}
    for name, path in sorted(labkit_modules(root, entries or entries_for(root)).items()):
        entry = [".py", path.read_text(encoding="utf-8"), []]
        vfs[name] = entry + [1] if path.name == "__init__.py" else entry
    vfs["calculator_ui"] = [".py", UI.read_text(encoding="utf-8"), []]
    return f"__BRYTHON__.loadBrythonPackage({json.dumps(vfs, sort_keys=True)})\n"


def brython_data() -> Path:
    spec = importlib.util.find_spec("brython")
    if spec is None or not spec.submodule_search_locations:
        raise ExtensionError("Brython not found: pip install -r requirements-book.txt")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    for name in RUNTIME:
        if not (data / name).is_file():
            raise ExtensionError(f"{data / name} is missing from the brython package")
    return data


class CalculatorDirective(SphinxDirective):
    required_arguments = 1
    option_spec = {"preset": directives.unchanged, **{k: directives.unchanged for k in KNOBS}}

    def run(self) -> list[nodes.Node]:
        kind = self.arguments[0]
        if kind not in KINDS:
            raise self.error(f"calculator kind {kind!r}: expected one of {', '.join(KINDS)}")
        attrs = " ".join(f'data-{k.replace("_", "-")}="{escape(v)}"' for k, v in sorted(self.options.items()))
        language = self.env.config.language
        html = (f'<div class="labkit-calc" data-kind="{kind}" {attrs}>'
                f'<p class="labkit-calc-status" data-not-loaded="{escape(words(NOT_LOADED, language))}">'
                f'{escape(words(LOADING, language))}</p></div>')
        if kind == "plans" and not _module_file(PLANNER, Path(self.env.srcdir)):
            raise self.error(f"the plans calculator needs {PLANNER}, not found in {self.env.srcdir}")
        self.env.metadata[self.env.docname]["labkit_calculator"] = True
        return [nodes.raw("", html, format="html")]


def _add_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    if not app.env.metadata.get(pagename, {}).get("labkit_calculator"):
        return
    for name in RUNTIME + ("labkit.brython.js",):
        app.add_js_file(f"{STATIC}/{name}", priority=800)
    app.add_js_file(None, body=NOT_LOADED_JS, priority=801)
    app.add_js_file(None, body="import calculator_ui\ncalculator_ui.main()", type="text/python",
                    priority=802)
    app.add_css_file("calculators.css")


def _used(app: Sphinx) -> bool:
    return any(meta.get("labkit_calculator") for meta in app.env.metadata.values())


def _check(app: Sphinx, env) -> None:
    """Once the pages are read: fail early if a page has a calculator and the browser could not
    run labkit (Brython missing, or a module that imports torch when it loads)."""
    if app.builder.format == "html" and _used(app):
        brython_data()
        labkit_modules(Path(app.srcdir), entries_for(Path(app.srcdir)))


def _add_static(app: Sphinx) -> None:
    static = str(HERE / "static")  # calculators.css
    if static not in app.config.html_static_path:
        app.config.html_static_path.append(static)


def _write(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html" or not _used(app):
        return
    dest = Path(app.outdir) / "_static" / STATIC
    dest.mkdir(parents=True, exist_ok=True)
    data = brython_data()
    for name in RUNTIME:
        shutil.copy2(data / name, dest / name)
    (dest / "labkit.brython.js").write_text(bundle(Path(app.srcdir)), encoding="utf-8")


def setup(app: Sphinx) -> dict:
    app.add_directive("calculator", CalculatorDirective)
    app.connect("builder-inited", _add_static)
    app.connect("env-updated", _check)
    app.connect("html-page-context", _add_scripts)
    app.connect("build-finished", _write)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
