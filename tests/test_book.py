"""The book builds with every Sphinx warning as an error, and every TOC page comes out whole."""

from __future__ import annotations

import importlib.util
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

# The book is built once per run, in the background (conftest.py): every worker reads it.


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


def test_each_bibliography_key_is_defined_once():
    """Two entries under one key (two branches adding the same paper) make the bibliography
    unreadable past them: the build then misses keys defined after, far from the cause."""
    keys = re.findall(r"^@\w+\{([^,\s]+),", (ROOT / "references.bib").read_text(encoding="utf-8"), re.M)
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"references.bib defines {twice} more than once"


def test_build_fails_on_a_warning(tmp_path):
    """A dangling cross-reference must fail the build (warnings are errors). The book here is the
    real configuration with one page, which builds cleanly but for the dangling reference."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("_config.yml", "references.bib"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "_ext", src / "_ext", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "_toc.yml").write_text("format: jb-book\nroot: intro\n", encoding="utf-8")
    (src / "intro.md").write_text("# A book of one page\n\nSee {doc}`no_such_page`.\n",
                                  encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_book.py"), "--source", str(src)],
        capture_output=True, text=True, timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"build with a dangling reference succeeded:\n{log[-3000:]}"
    assert "no_such_page" in log


class _Text(HTMLParser):
    """The text of a page outside <script> and <style>, line by line."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.lines += [ln.strip() for ln in data.splitlines() if ln.strip()]


def test_no_page_shows_test_machinery(built_book, toc_page):
    """nbval's markers belong in cell tags (nbval-ignore-output), which the page does not show."""
    text = _Text()
    text.feed((built_book.html / f"{toc_page}.html").read_text(encoding="utf-8"))
    shown = [ln for ln in text.lines if "NBVAL" in ln]  # the markers are upper case
    assert not shown, f"{toc_page} shows nbval's markers (use the cell tag instead): {shown}"


def _next_link(html: Path, docname: str) -> str | None:
    page = (html / f"{docname}.html").read_text(encoding="utf-8")
    found = re.search(r'<a class="right-next"\s+href="([^"]+)"', page)
    return found and str((Path(docname).parent / found.group(1)).as_posix())


def test_each_chapter_is_followed_by_its_lab_then_the_next_chapter(built_book):
    """Reading order, by each page's "Next" link: chapter N, its lab, chapter N + 1."""
    chapters = sorted(f"chapters/{p.stem}" for p in (ROOT / "chapters").glob("[0-9]*.md"))
    for chapter, following in zip(chapters, chapters[1:] + [None]):
        lab = chapter.replace("chapters/", "labs/")
        if not (ROOT / f"{lab}.ipynb").is_file():
            continue
        nxt = _next_link(built_book.html, chapter)
        assert nxt == f"chapters/../{lab}.html", f"{chapter}: Next goes to {nxt}, not to {lab}"
        if following:
            nxt = _next_link(built_book.html, lab)
            assert nxt == f"labs/../{following}.html", f"{lab}: Next goes to {nxt}"


def test_gpu_results_is_a_page_and_links_to_it_open_it(built_book, toc_page):
    """GPU_RESULTS.md is a page; a link to it, on GitHub or as a document, opens that page."""
    assert (built_book.html / "GPU_RESULTS.html").is_file()
    text = (built_book.html / f"{toc_page}.html").read_text(encoding="utf-8")
    outside = re.findall(r'href="(https://github\.com/[^"]*/GPU_RESULTS\.md[^"]*)"', text)
    assert not outside, f"{toc_page} links to GPU_RESULTS.md on GitHub, not to the page: {outside}"
    source = _source(toc_page).read_text(encoding="utf-8")
    if re.search(r"\]\(https://github\.com/\S+/GPU_RESULTS\.md|\{doc\}`[^`]*GPU_RESULTS", source):
        assert re.search(r'href="(\.\./)*GPU_RESULTS\.html', text), f"{toc_page}: no link to it"


def _placeholder_notice():
    spec = importlib.util.spec_from_file_location("placeholder_notice",
                                                  ROOT / "_ext" / "placeholder_notice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_banner_follows_the_repository_setting():
    notice = _placeholder_notice()
    assert notice.notice_for(notice.PLACEHOLDER_URL)
    assert notice.notice_for(notice.PLACEHOLDER_URL + "/")
    assert notice.notice_for("https://github.com/someone/published-course") is None
    assert notice.notice_for(None) is None


def test_a_github_link_to_a_page_of_the_book_is_recognised():
    spec = importlib.util.spec_from_file_location("own_pages", ROOT / "_ext" / "own_pages.py")
    own = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own)
    url, docs = "https://github.com/o/course", {"GPU_RESULTS", "labs/01_memory_wall"}
    assert own.page_for(f"{url}/blob/main/GPU_RESULTS.md", url, "main", docs) == "GPU_RESULTS"
    assert own.page_for(f"{url}/blob/main/labs/01_memory_wall.ipynb#top", url, "main",
                        docs) == "labs/01_memory_wall"
    assert own.page_for(f"{url}/blob/dev/GPU_RESULTS.md", url, "main", docs) is None  # branch
    assert own.page_for(f"{url}/blob/main/README.md", url, "main", docs) is None  # not a page
    assert own.page_for("https://github.com/x/y/blob/main/GPU_RESULTS.md", url, "main",
                        docs) is None
