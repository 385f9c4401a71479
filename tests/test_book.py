"""The book builds with every Sphinx warning as an error, and every TOC page comes out whole."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
HIDDEN_TAGS = {"remove-cell", "remove-output", "remove_cell", "remove_output"}

# One xdist worker builds the book once for this module and tests/test_browser.py.
pytestmark = pytest.mark.xdist_group("book")


class _Tags(HTMLParser):
    """Collect the attributes of <img> and <script> tags of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict] = []
        self.scripts: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "img":
            self.imgs.append(dict(attrs))
        elif tag == "script":
            self.scripts.append(dict(attrs))


def _parse(page: Path) -> _Tags:
    tags = _Tags()
    tags.feed(page.read_text(encoding="utf-8"))
    return tags


def _source(docname: str) -> Path:
    for suffix in (".md", ".ipynb"):
        if (ROOT / f"{docname}{suffix}").is_file():
            return ROOT / f"{docname}{suffix}"
    raise FileNotFoundError(f"no .md or .ipynb source for TOC entry {docname!r}")


def _visible_image_outputs(notebook: Path) -> int:
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    count = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or HIDDEN_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        for out in cell.get("outputs", []):
            if any(m in out.get("data", {}) for m in IMAGE_MIMES):
                count += 1
    return count


def test_build_succeeds_with_warnings_as_errors(built_book):
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    assert "Book built. Open" in built_book.log
    assert (built_book.html / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()


def test_index_redirects_to_intro(built_book):
    index = built_book.html / "index.html"
    assert index.is_file(), "index.html missing"
    assert 'url=intro.html' in index.read_text(encoding="utf-8")


def test_page_is_built(built_book, toc_page):
    page = built_book.html / f"{toc_page}.html"
    assert page.is_file(), f"{toc_page} ({_source(toc_page).name}) produced no HTML page"
    text = page.read_text(encoding="utf-8")
    assert re.search(r"<h1[ >]", text), f"{page.name} has no title (<h1>)"


def test_page_images_exist(built_book, toc_page):
    page = built_book.html / f"{toc_page}.html"
    imgs = _parse(page).imgs
    for img in imgs:
        src = img.get("src", "")
        if urlsplit(src).scheme in ("http", "https", "data"):
            continue
        target = (page.parent / unquote(urlsplit(src).path)).resolve()
        assert target.is_file(), f"{page.name}: <img src={src!r}> points to a missing file"
    source = _source(toc_page)
    if source.suffix == ".ipynb":
        expected = _visible_image_outputs(source)
        figures = [i for i in imgs if "/_images/" in "/" + i.get("src", "")]
        assert len(figures) >= expected, (
            f"{source.name} has {expected} figure outputs but its page shows {len(figures)}")


def test_math_uses_local_mathjax(built_book, toc_page):
    page = built_book.html / f"{toc_page}.html"
    text = page.read_text(encoding="utf-8")
    srcs = [s.get("src", "") for s in _parse(page).scripts]
    assert not [s for s in srcs if "mathjax" in s.lower() and "://" in s], \
        f"{page.name} loads MathJax from the network: {srcs}"
    if 'class="math' in text:
        assert any(s.split("?")[0].endswith("_static/mathjax/tex-mml-chtml.js") for s in srcs), \
            f"{page.name} has math but does not load the local MathJax"


@pytest.mark.parametrize("chapter", sorted(p.stem for p in (ROOT / "chapters").glob("[0-9]*.md")))
def test_every_chapter_has_a_figure(chapter):
    """A chapter teaches with at least one figure: a figure file or one glued from its lab."""
    text = (ROOT / "chapters" / f"{chapter}.md").read_text(encoding="utf-8")
    figures = re.findall(r"^(?:```+|:::+)\{figure\} (\S+)", text, re.M)
    glued = re.findall(r"^(?:```+|:::+)\{(?:glue(?::figure)?|glued-figure)\} \w+", text, re.M)
    assert figures or glued, f"{chapter}.md has no figure"
    for path in figures:
        assert (ROOT / "chapters" / path).is_file(), f"{chapter}.md: {path} does not exist"


def test_build_fails_on_a_warning(tmp_path):
    """A dangling cross-reference must fail the build (warnings are errors)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("_config.yml", "_toc.yml", "references.bib", "intro.md", "references.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "_ext", src / "_ext", ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("chapters", "labs", "exercises"):
        shutil.copytree(ROOT / sub, src / sub, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    with open(src / "intro.md", "a", encoding="utf-8") as f:
        f.write("\nSee {doc}`no_such_page`.\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_book.py"), "--source", str(src)],
        capture_output=True, text=True, timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"build with a dangling reference succeeded:\n{log[-3000:]}"
    assert "no_such_page" in log
