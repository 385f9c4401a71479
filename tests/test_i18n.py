"""The Chinese edition: complete and current catalogues, the glossary kept (its terms, its forbidden
variants, its display-math rule, one title per chapter), both editions built and linked page to
page, the Chinese pages read as rendered (no English heading, table cell, sidebar caption, title or
prose word outside the glossary's kept list; no translation Sphinx dropped; 式 (N) references), its
search index, and the Chinese exercise notebooks made from their catalogue.

The catalogues are checked against message templates regenerated here from the English sources
(scripts/i18n.py, the gettext builder into a temporary folder), so a change to an English
paragraph fails this test until its translation follows. The built editions come from the one
book build of the session (the ``built_book`` fixture, shared with test_book.py and
test_browser.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import tokenize
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCALE_DIR = ROOT / "locales" / "zh_CN" / "LC_MESSAGES"

# The book is built once per run, in the background (conftest.py): every worker reads it.


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


i18n = _load("i18n_script", ROOT / "scripts" / "i18n.py")
switch = _load("language_switch", ROOT / "_ext" / "language_switch.py")


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> Path:
    """The message templates (.pot) of the current English sources."""
    return i18n.make_templates(tmp_path_factory.mktemp("pot"))


# ----------------------------------------------------------------------------- completeness
def test_every_message_is_translated_and_current(templates):
    results = i18n.compare(templates)
    print(i18n.report(results, details=False))
    done, total = i18n.share(results)
    print(f"Chinese edition: {done} of {total} messages translated "
          f"({100 * done / max(total, 1):.1f}%)")
    bad = [c for c in results if not c.ok]
    assert not bad, ("untranslated, fuzzy, obsolete or stale messages (scripts/i18n.py update, "
                     "then translate; scripts/i18n.py check lists them):\n"
                     + i18n.report(bad, details=True))


def test_every_page_and_the_notebooks_have_a_template(templates):
    """The templates cover every page of the book and the exercise notebooks: nothing escapes
    the check above because it has no template."""
    toc_pages = _load("book_conftest", ROOT / "conftest.py").toc_pages
    names = {p.relative_to(templates).with_suffix("").as_posix() for p in templates.rglob("*.pot")}
    assert set(toc_pages()) | {i18n.NOTEBOOKS_DOMAIN} <= names, sorted(names)


def _copy_catalogue(templates: Path, tmp_path: Path, name: str = "exercises/index"):
    """A copy of one template and a complete catalogue for it, in tmp_path: (pot_dir, po path)."""
    from babel.messages.pofile import write_po

    pot_dir, locale = tmp_path / "pot", tmp_path / "locale"
    (pot_dir / name).parent.mkdir(parents=True)
    shutil.copy2(templates / f"{name}.pot", pot_dir / f"{name}.pot")
    catalog = i18n.read_catalogue(pot_dir / f"{name}.pot")
    for m in catalog:
        if m.id:
            m.string = "译文 " + m.id
    po = locale / f"{name}.po"
    po.parent.mkdir(parents=True)
    with open(po, "wb") as f:
        write_po(f, catalog)
    return pot_dir, locale, po


def _rewrite(po: Path, change) -> None:
    from babel.messages.pofile import write_po

    catalog = i18n.read_catalogue(po)
    change(catalog)
    with open(po, "wb") as f:
        write_po(f, catalog)


def test_the_check_finds_each_kind_of_gap(templates, tmp_path):
    """The completeness check, on a copy: a complete catalogue passes, each kind of gap fails."""
    pot_dir, locale, po = _copy_catalogue(templates, tmp_path)
    first = next(m.id for m in i18n.read_catalogue(po) if m.id)
    [clean] = i18n.compare(pot_dir, locale)
    assert clean.ok and clean.translated == clean.total > 0

    def untranslate(cat):
        cat[first].string = ""

    def fuzz(cat):
        cat[first].flags.add("fuzzy")

    def add_stale(cat):
        cat.add("A paragraph the English no longer has.", "不再有的段落。")

    def obsolete(cat):
        from babel.messages.catalog import Message

        cat.obsolete["Gone"] = Message("Gone", "已删除")  # written as "#~ msgid" lines

    expected = {untranslate: "untranslated", fuzz: "fuzzy", add_stale: "stale",
                obsolete: "obsolete"}
    for change, kind in expected.items():
        pot_dir, locale, po = _copy_catalogue(templates, tmp_path / kind)
        _rewrite(po, change)
        [counts] = i18n.compare(pot_dir, locale)
        assert not counts.ok and getattr(counts, kind), f"{kind} not found: {counts}"

    # A message the English gained (it is in the template, not in the catalogue) is untranslated.
    pot_dir, locale, po = _copy_catalogue(templates, tmp_path / "gained")
    _rewrite(po, lambda cat: cat.delete(first))
    [counts] = i18n.compare(pot_dir, locale)
    assert counts.untranslated == [first]
    # A catalogue without a template, and a template without a catalogue, both fail.
    (locale / "orphan.po").write_bytes(po.read_bytes())
    (pot_dir / "new_page.pot").write_bytes((pot_dir / "exercises" / "index.pot").read_bytes())
    problems = {c.name: c.problem for c in i18n.compare(pot_dir, locale)}
    assert problems["orphan"] and problems["new_page"]


# ----------------------------------------------------------------------------- glossary
def test_the_glossary_is_kept():
    problems = i18n.glossary_problems()
    assert not problems, ("translations that do not use the glossary's term "
                          "(locales/zh_CN/GLOSSARY.md):\n" + "\n".join(problems))


def test_glossary_rule(tmp_path):
    terms = i18n.glossary()
    assert {"micro-batch", "KV cache", "activation checkpointing"} <= set(terms)
    pattern = i18n.term_pattern("micro-batch")
    for text in ("two micro batches", "micro-batches", "Micro-Batch size"):
        assert pattern.search(text), text
    assert not i18n.term_pattern("shard").search("reshard the shard_params")
    # On a catalogue: the term in code is not prose; in prose, the Chinese term must be there.
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    catalog = Catalog(locale="zh_CN")
    catalog.add("Each rank keeps one shard.", "每个 rank 保留一个切片。")  # not the glossary's
    catalog.add("Each rank keeps one shard of the states.", "每个 rank 保留状态的一个分片。")
    catalog.add("Call `shard(x)`.", "调用 `shard(x)`。")
    (tmp_path / "page.po").parent.mkdir(exist_ok=True)
    with open(tmp_path / "page.po", "wb") as f:
        write_po(f, catalog)
    problems = i18n.glossary_problems(tmp_path)
    assert len(problems) == 1 and "切片" in problems[0], problems


def _catalogue(tmp_path: Path, pairs) -> Path:
    """A folder holding one catalogue, page.po, with the (English, translation) pairs."""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    catalog = Catalog(locale="zh_CN")
    for english, chinese in pairs:
        catalog.add(english, chinese)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "page.po", "wb") as f:
        write_po(f, catalog)
    return tmp_path


def test_no_forbidden_variant():
    """No catalogue uses a variant the glossary forbids (显存墙, 规约, 临时量, "增长了 N 倍", ...)."""
    problems = i18n.forbidden_problems()
    assert not problems, ("forbidden variants (locales/zh_CN/GLOSSARY.md, Forbidden variants):\n"
                          + "\n".join(problems))


def test_each_forbidden_variant_is_rejected(tmp_path):
    """Each forbidden variant, planted in a translation (the glossary's own example), is found;
    the same words in code or math, and the forms to use instead, are not."""
    examples = i18n.forbidden_examples()
    assert len(examples) >= 15 and {"显存墙", "规约", "临时量", "两个动量", "内存计量器"} <= set(examples)
    for i, (pattern, example) in enumerate(examples.items()):
        folder = _catalogue(tmp_path / f"variant{i}",
                            [("Some English.", "前文。" + example + "。后文。")])
        problems = i18n.forbidden_problems(folder)
        assert problems and all(p.startswith("page: forbidden") for p in problems), (pattern,
                                                                                     example)
    clean = _catalogue(tmp_path / "clean", [
        ("x", "在 64 张 GPU 上，峰值增至原来的 2 倍，每个节点一个 GPU 集群；用显存计量器测量。"),
        ("y", "调用 `bucket_size(x)` 与 `\"dp\"`；$M_\\text{et al}$；突破 GPU 内存墙。"),
        ("z", "速度最高可达 Hugging Face 实现的 3 倍，序列条数减为 1/16。"),
        ("w", "即使系统预先知道每个请求的确切长度。")])
    assert i18n.forbidden_problems(clean) == []


def test_the_review_s_sample_is_judged_and_its_variants_are_gone():
    """scripts/zh_review.py: the review's 283 sampled messages (../shared/reviews/zh.md, Appendix
    A, at 0766ae6) reproduce its verdict table; each whose translation or English changed, or
    that it judged other than OK, has a verdict pinned to today's translation; the term variants
    it asked to remove count 0 in every catalogue. A changed translation needs a new verdict."""
    review = _load("zh_review", ROOT / "scripts" / "zh_review.py")
    try:
        old = review.old_catalogues()
    except Exception as error:  # a shallow clone has no 0766ae6
        pytest.skip(f"the reviewed commit {review.REVIEWED} is not in this clone: {error}")
    new = review.new_catalogues()
    items = review.sample(old, new)
    before, after = review.load_verdicts()
    assert len(items) == 283
    problems = review.judge(items, before, after) + review.review_table_problems(items, old)
    problems += review.term_problems(review.count_terms(new), review.markup_counts(new))
    assert not problems, "\n".join(problems)
    assert {it["after"] for it in items} <= {*review.KINDS, "GONE"}
    judged = next(it for it in items if (it["catalogue"], it["index"]) in after)
    unjudged = next(it for it in items if (it["catalogue"], it["index"]) not in after)
    for it in (judged, unjudged):  # a translation edited since: its verdict must be given again
        it["zh_now"] = (it["zh_now"] or "") + "。"
    again = review.judge([judged, unjudged], before, after)
    assert len([p for p in again if "translation" in p]) == 2, again


def test_no_translation_that_sphinx_would_drop(tmp_path):
    """A translation starting like a list item ("1. ", "+ ") is one Sphinx silently replaces by the
    English; every such translation escapes its marker ("1\\. 显存都去哪儿了")."""
    assert not i18n.dropped_problems(), "\n".join(i18n.dropped_problems())
    folder = _catalogue(tmp_path, [("1. Where the memory goes", "1. 显存都去哪儿了"),
                                   ("+ gradients", "+ 梯度"), ("2. ZeRO", "2\\. ZeRO"),
                                   ("stage 1", "阶段 1")])
    assert [p.split(": ")[-1] for p in i18n.dropped_problems(folder)] == ["1. 显存都去哪儿了",
                                                                         "+ 梯度"]


def test_display_math_follows_the_text_rule(tmp_path):
    """In display math a symbol's \\text{} subscript stays English and every other \\text{} is
    translated (GLOSSARY.md, "Display math"), in every catalogue and on planted equations."""
    assert not i18n.math_text_problems(), "\n".join(i18n.math_text_problems())
    folder = _catalogue(tmp_path, [
        (r"M_\text{model states} = 16\Psi \text{ bytes.}",
         r"M_\text{model states} = 16\Psi \text{ 字节。}"),  # right
        (r"M_\text{model states} = 2\Psi \text{ bytes.}",
         r"M_\text{模型状态} = 2\Psi \text{ 字节。}"),  # the symbol translated
        (r"M_\text{model states} = 4\Psi \text{ bytes.}",
         r"M_\text{model states} = 4\Psi \text{ bytes.}"),  # the prose left in English
        (r"A = \underbrace{x}_{\text{fp32 weights}}", r"A = \underbrace{x}_{\text{fp32 权重}}")])
    problems = i18n.math_text_problems(folder)
    assert len(problems) == 2 and "subscript" in problems[0] and "'bytes'" in problems[1], problems


def _title(name: str) -> tuple[str, str]:
    """(English, Chinese) of a page's first message, its title."""
    first = next(m for m in i18n.read_catalogue(LOCALE_DIR / f"{name}.po") if m.id)
    return first.id, first.string


def test_one_title_per_chapter():
    """A chapter's title reads the same in the chapter, its lab, the exercises table and the
    exercise notebook: where two English titles agree (or one is the other's head, before a
    colon), so do the Chinese ones."""
    table = {m.id: m.string for m in i18n.read_catalogue(LOCALE_DIR / "exercises" / "index.po")
             if m.id}
    notebooks = {m.id: m.string for m in i18n.read_catalogue(
        LOCALE_DIR / f"{i18n.NOTEBOOKS_DOMAIN}.po") if m.id}
    chapters = sorted(p.stem for p in (LOCALE_DIR / "chapters").glob("*.po"))
    assert len(chapters) >= 10
    for name in chapters:
        n = int(name[:2])
        titles = [_title(f"chapters/{name}")]
        en, zh = _title(f"labs/{name}")
        titles.append((re.sub(rf"^Lab {n}: ", "", en), re.sub(rf"^实验 {n}：", "", zh)))
        [(en, zh)] = [(e, z) for e, z in table.items() if e.startswith(f"{n}. ")]
        titles.append((en[len(f"{n}. "):], re.sub(rf"^{n}\\?\. ", "", zh)))
        [(en, zh)] = [(e, z) for e, z in notebooks.items() if e.startswith(f"# Chapter {n} ")]
        titles.append((en.split(": ", 1)[1], zh.split("：", 1)[1]))
        for en_a, zh_a in titles:
            for en_b, zh_b in titles:
                if en_a.lower() == en_b.lower() or en_a.lower().startswith(en_b.lower() + ":"):
                    assert zh_a.startswith(zh_b), (f"chapter {n}: {en_b!r} is {zh_b!r} in one "
                                                   f"place and {zh_a!r} in another")


# ----------------------------------------------------------------------------- exercise notebooks
def _student_notebooks():
    return sorted((ROOT / "exercises" / "student").glob("*.ipynb"))


def test_chinese_exercise_notebooks_are_up_to_date():
    """exercises/student/zh/ is what the catalogue makes of the English student notebooks
    (scripts/exercises.py build writes it): same code, tests and metadata, translated prose; the
    setup cell's LANGUAGE, which picks the lines the notebook prints, is "zh_CN"."""
    exercises = _load("exercises_script", ROOT / "scripts" / "exercises.py")
    translations = i18n.translations_of(LOCALE_DIR / f"{i18n.NOTEBOOKS_DOMAIN}.po")
    committed = sorted(p.name for p in (ROOT / "exercises" / "student" / "zh").glob("*.ipynb"))
    assert committed == [p.name for p in _student_notebooks()]
    for path in _student_notebooks():
        english = json.loads(path.read_text(encoding="utf-8"))
        fresh, _ = i18n.translate_notebook(json.loads(path.read_text(encoding="utf-8")), translations)
        fresh = exercises._speak(fresh, "zh_CN")
        zh = json.loads((path.parent / "zh" / path.name).read_text(encoding="utf-8"))
        assert zh == fresh, f"exercises/student/zh/{path.name} is stale: scripts/exercises.py build"
        code = [c for c in english["cells"] if c["cell_type"] != "markdown"]
        zh_code = [c for c in zh["cells"] if c["cell_type"] != "markdown"]
        assert sum('LANGUAGE = "zh_CN"' in "".join(c["source"]) for c in zh_code) == 1, path.name
        assert [c for c in exercises._speak({"cells": zh_code}, "en")["cells"]] == code
        assert zh["metadata"]["otter"] == english["metadata"]["otter"]


def test_markdown_blocks_round_trip():
    text = "# Title\n\nA paragraph\nover two lines.\n\n```python\nx = 1\n\ny = 2\n```\n\n---"
    blocks = i18n.markdown_blocks(text)
    assert blocks == ["# Title", "A paragraph\nover two lines.", "```python\nx = 1\n\ny = 2\n```",
                      "---"]
    assert [i18n.is_message(b) for b in blocks] == [True, True, False, False]
    nb = {"cells": [{"cell_type": "markdown", "source": text.splitlines(keepends=True)}],
          "metadata": {}}
    out, missing = i18n.translate_notebook(nb, {"# Title": "# 标题"})
    assert "".join(out["cells"][0]["source"]).startswith("# 标题\n\nA paragraph")
    assert missing == ["A paragraph\nover two lines."]


# ----------------------------------------------------------------------------- the built editions
class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.switch: list[str] = []
        self.html_lang = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag == "html":
            self.html_lang = attrs.get("lang")
        if tag == "a" and "language-switch-link" in (attrs.get("class") or ""):
            self.switch.append(attrs.get("href", ""))


def _links(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def test_twin_urls():
    en, zh = switch.edition_of("en"), switch.edition_of("zh_CN")
    assert switch.twin_url("intro.html", "en", zh) == "zh/intro.html"
    assert switch.twin_url("chapters/02_zero.html", "en", zh) == "../zh/chapters/02_zero.html"
    assert switch.twin_url("intro.html", "zh_CN", en) == "../intro.html"
    assert switch.twin_url("labs/02_zero.html", "zh_CN", en) == "../../labs/02_zero.html"
    with pytest.raises(ValueError, match="language"):
        switch.edition_of("fr")


def test_chinese_page_is_built_and_links_both_ways(built_book, toc_page):
    """Every page exists in both editions, each links to the other, and the links resolve to the
    twin page as files (so they work from file:// too)."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    en_page = built_book.html / f"{toc_page}.html"
    zh_page = built_book.zh_html / f"{toc_page}.html"
    assert zh_page.is_file(), f"no Chinese page for {toc_page}"
    assert re.search(r"<h1[ >]", zh_page.read_text(encoding="utf-8")), f"zh {toc_page}: no <h1>"
    for page, twin in ((en_page, zh_page), (zh_page, en_page)):
        links = _links(page)
        assert len(links.switch) == 1, f"{page}: {len(links.switch)} language links"
        target = (page.parent / unquote(urlsplit(links.switch[0]).path)).resolve()
        assert target == twin.resolve(), f"{page}: the language link leads to {target}"
    assert _links(zh_page).html_lang.lower().startswith("zh"), f"{zh_page}: not marked Chinese"
    assert (built_book.zh_html / "_static" / "mathjax" / "tex-mml-chtml.js").is_file()


_NUMBER = re.compile(r"[\d\s.,:%+\-−×x/()]*\d[\d\s.,:%+\-−×x/()]*")


def test_chinese_page_images_and_glued_numbers(built_book, toc_page):
    """The Chinese page shows as many figures as the English one, and outside the labs' own
    pages (their outputs) each in Chinese: another image file, its twin drawn from the same
    numbers. Its glued numbers are the English page's: they come from the labs, not from a
    copy; glued words differ, in the page's language."""
    pages = (built_book.html / f"{toc_page}.html", built_book.zh_html / f"{toc_page}.html")
    texts = [p.read_text(encoding="utf-8") for p in pages]
    imgs = [re.findall(r'<img[^>]*src="([^"]+)"', t) for t in texts]
    assert len(imgs[0]) == len(imgs[1]), (
        f"{toc_page}: {len(imgs[0])} images in English, {len(imgs[1])} in Chinese")
    files = [[(page.parent / unquote(urlsplit(src).path)).resolve() for src in srcs
              if urlsplit(src).scheme not in ("http", "https", "data")]
             for page, srcs in zip(pages, imgs)]
    for target in files[1]:
        assert target.is_file(), f"zh {toc_page}: <img src={target.name!r}> is missing"
    if not toc_page.startswith("labs/"):
        for en, zh in zip(*files):
            if en.suffix == ".png":
                assert en.read_bytes() != zh.read_bytes(), (
                    f"zh {toc_page}: shows the English figure {en.name}")
    glued = [re.findall(r'<span class="pasted-text">(.*?)</span>', t) for t in texts]
    assert len(glued[0]) == len(glued[1]), f"{toc_page}: glued texts differ in number: {glued}"
    numbers = [sorted(g for g in gs if _NUMBER.fullmatch(g)) for gs in glued]
    assert numbers[0] == numbers[1], f"{toc_page}: glued numbers differ: {numbers}"


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_every_figure_is_drawn_in_chinese():
    """Each static figure (scripts/make_figures.py) has its Chinese twin NAME.zh_CN.png, which
    the Chinese edition shows (Sphinx's figure_language_filename, left at its default), the same
    size in pixels; each figure a lab glues has its Chinese twin ``key_zh``, another image (the
    inline backend crops each to its drawing, so their sizes may differ)."""
    figures = sorted((ROOT / "chapters" / "figures").glob("*.png"))
    english = [f for f in figures if not f.stem.endswith(".zh_CN")]
    make_figures = _load("make_figures", ROOT / "scripts" / "make_figures.py")
    assert sorted(f.stem for f in english) == sorted(make_figures.FIGURES), (
        "chapters/figures/ and scripts/make_figures.py draw different figures")
    for figure in english:
        twin = figure.with_name(f"{figure.stem}.zh_CN.png")
        assert twin.is_file(), f"{figure.name} has no Chinese twin {twin.name}"
        assert twin.read_bytes() != figure.read_bytes(), f"{twin.name} is the English figure"
        assert _png_size(twin) == _png_size(figure), f"{twin.name}: another size"
    for badge in (ROOT / "chapters" / "figures").glob("*.svg"):  # the Colab badge's words
        if not badge.stem.endswith(".zh_CN"):
            twin = badge.with_name(f"{badge.stem}.zh_CN.svg")
            assert twin.is_file(), f"{badge.name} has no Chinese twin {twin.name}"
            assert re.search(r">[^<]*[\u4e00-\u9fff][^<]*</text>", twin.read_text(encoding="utf-8"))
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    pattern = config["sphinx"]["config"].get("figure_language_filename", "{root}.{language}{ext}")
    assert pattern == "{root}.{language}{ext}", f"figure_language_filename is {pattern!r}"
    import base64

    glued_figures = 0
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):
        glued = _lab_glue(lab)
        for key, bundle in glued.items():
            if "image/png" not in bundle or key.endswith("_zh"):
                continue
            glued_figures += 1
            twin = glued.get(key + "_zh", {})
            assert "image/png" in twin, f"{lab.name}: figure {key} has no Chinese twin {key}_zh"
            pngs = [base64.b64decode("".join(b["image/png"])) for b in (bundle, twin)]
            assert pngs[0] != pngs[1], f"{lab.name}: {key}_zh is the English figure"
    assert glued_figures >= 10, f"only {glued_figures} glued figures found in the labs"


class _ProseText(HTMLParser):
    """A page's text outside <script>, <style>, <pre> and <code>."""

    SKIP = ("script", "style", "pre", "code")

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._skip += tag in self.SKIP

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in self.SKIP and self._skip > 0

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


# Markup that a translation broke, so that it shows as text: a MyST role, a reference-style link
# (its definition is not in the message), an inline link, a directive fence.
RAW_MARKUP = re.compile(r"\{[\w:.-]+\}`|\]\[[^\]\s]*\]|\]\((?:https?:|\.{0,2}/|#)[^)\s]*\)"
                        r"|^\s*(?:```|:::)\s*\{", re.M)


def test_no_page_shows_raw_markup(built_book, toc_page):
    """A translation keeps MyST's roles and links working: none shows as raw text."""
    for html in (built_book.html, built_book.zh_html):
        text = _ProseText()
        text.feed((html / f"{toc_page}.html").read_text(encoding="utf-8"))
        raw = RAW_MARKUP.findall("".join(text.parts))
        assert not raw, f"{html.name}/{toc_page}: raw MyST markup shown as text: {raw}"


# What a Chinese reader sees: headings, table cells, sidebar captions and titles in Chinese. Code,
# math, lab outputs (the labs print English: another issue) and citations are left out; the
# Latin words allowed are the glossary's "Kept in English" list, and one-letter symbols.
_SHOWN_LATIN = re.compile(r"[0-9]*[A-Za-z][A-Za-z0-9]*(?:[-/'’.][A-Za-z0-9]+)*")
# An English gloss after its Chinese term, or a quoted English message: （...） or “...”
_GLOSS = re.compile(r"（[^（）\u4e00-\u9fff]*）|“[^“”\u4e00-\u9fff]*”")
# File names, dotted and snake_case code names, addresses: GPU_RESULTS.md, torch.cuda, c_attn
_FILE_OR_CODE = re.compile(r"\S*_\S*|\w+(?:\.\w+)+(?:/\S*)?")
_NOT_PROSE = (".cell_output, .output, script, style, code, pre, .math, mjx-container, "
              "a.headerlink, .bibtex-citation, .language-switch, .citation")


@functools.lru_cache(maxsize=None)
def kept_latin() -> frozenset[str]:
    """The Latin words a Chinese page may show: the glossary's "Kept in English" list and the
    authors' names in references.bib (lower case)."""
    bib = (ROOT / "references.bib").read_text(encoding="utf-8")
    names = set()
    for authors in re.findall(r"author\s*=\s*\{(.*?)\},?\s*$", bib, re.M):
        for author in authors.split(" and "):
            names |= set(re.findall(r"[A-Za-z][A-Za-z'-]+", author.strip("{}")))
    return frozenset(i18n.kept_english() | {n.lower() for n in names})


def english_words(text: str, kept: set[str]) -> list[str]:
    """The Latin words of ``text`` that a Chinese page may not show: not in ``kept``, whole or
    part by part (a hyphenated name; number parts such as the 1 of ZeRO-1 aside), and longer than
    one letter (a symbol)."""
    words = []
    text = _FILE_OR_CODE.sub(" ", _GLOSS.sub(" ", text))
    for word in _SHOWN_LATIN.findall(text):
        lower = word.lower().rstrip(".'’")
        parts = [p for p in re.split(r"[-/]", lower) if p and not p[0].isdigit()]
        if lower in kept or all(p in kept or len(p) == 1 for p in parts):
            continue
        words.append(word)
    return words


def _texts(soup, selector: str) -> list[str]:
    return [" ".join(el.get_text(" ").split()) for el in soup.select(selector)]


_PARTS = {"heading": "article h1, article h2, article h3, article h4, article h5",
          "table cell": "article th, article td",
          "sidebar caption": "nav p.caption, .bd-sidebar p.caption",
          "title": "title, .logo__title",
          "prose": "article p, article li, article dt, article dd, article figcaption, "
                   "article caption, article .admonition-title"}


@functools.lru_cache(maxsize=None)
def _shown(page: str) -> dict[str, list[str]]:
    """{part: the texts a reader sees} of a built page (one parse per page for all the tests
    below), without code, math, lab outputs or citations. Glued text is kept: the labs glue
    words in the page's language (labkit.book.glue's ``zh=``)."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(Path(page).read_text(encoding="utf-8"), "html.parser")
    for element in soup.select(_NOT_PROSE):
        element.decompose()
    return {part: _texts(soup, selector) for part, selector in _PARTS.items()}


def test_english_words_rule():
    kept = kept_latin()
    assert english_words("ZeRO-1 在 8 张 H100 上，fp32，GPT-2，LLaMA-7B，Megatron-LM", kept) == []
    assert english_words("data parallelism 与 ZeRO", kept) == ["data", "parallelism"]
    assert english_words("kept tensor", kept) == ["kept", "tensor"]


def test_chinese_page_shows_no_english(built_book, toc_page):
    """No heading, table cell, sidebar caption or title of a Chinese page is in English: each
    shows only Chinese and the Latin words the glossary keeps."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    shown = _shown(str(built_book.zh_html / f"{toc_page}.html"))
    kept = kept_latin()
    for part in ("heading", "sidebar caption", "title"):
        assert shown[part], f"zh {toc_page}: no {part} found ({_PARTS[part]})"
    english = {f"{part}: {text}": words for part in ("heading", "table cell", "sidebar caption",
                                                     "title")
               for text in shown[part] if (words := english_words(text, kept))}
    assert not english, f"zh {toc_page}: shown in English: {english}"


def test_chinese_page_shows_its_translations(built_book, toc_page):
    """The rendered Chinese page against its catalogue: no English message that has a
    translation is shown as a whole heading, cell, paragraph or list item (the case of a
    translation Sphinx dropped)."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    parts = _shown(str(built_book.zh_html / f"{toc_page}.html"))
    shown = set(parts["heading"] + parts["table cell"] + parts["prose"])
    catalogue = LOCALE_DIR / f"{toc_page}.po"
    translated = {" ".join(m.id.split()) for m in i18n.read_catalogue(catalogue)
                  if m.id and m.string and m.string.replace("\\", "") != m.id
                  and not re.search(r"[`${}*\[\]_<>\\]", m.id)}
    dropped = sorted(shown & translated)
    assert not dropped, f"zh {toc_page}: shown in English though translated: {dropped}"


def _lab_glue(lab: Path) -> dict[str, dict]:
    """{key: the mime bundle it glued} of a lab's committed outputs."""
    found = {}
    for cell in json.loads(lab.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            scrap = output.get("metadata", {}).get("scrapbook", {})
            if scrap.get("name"):
                prefix = scrap["mime_prefix"]
                found[scrap["name"]] = {k[len(prefix):]: v for k, v in output["data"].items()
                                        if k.startswith(prefix)}
    return found


def _glued_words(bundle: dict) -> str | None:
    """The text a glue bundle holds when it is words (a str), else None (a number, a figure)."""
    import ast

    if "image/png" in bundle:
        return None
    value = ast.literal_eval("".join(bundle.get("text/plain", "None")))
    return value if isinstance(value, str) else None


@pytest.mark.parametrize("lab", sorted(p.name for p in (ROOT / "labs").glob("*.ipynb")))
def test_glued_words_have_a_chinese_twin(lab):
    """A lab that glues English words glues their Chinese too (``key_zh``, which the Chinese
    edition reads: _ext/i18n_glue.py), and the Chinese has no English word; a twin's key exists
    in English too. Numbers need no twin: the prose of each language carries the words."""
    glued = _lab_glue(ROOT / "labs" / lab)
    kept = kept_latin()
    twins = {k for k in glued if k.endswith("_zh")}
    assert all(k[:-3] in glued for k in twins), f"{lab}: a _zh key without its English key"
    missing = sorted(k for k, bundle in glued.items() if k not in twins
                     and (text := _glued_words(bundle)) and english_words(text, kept)
                     and k + "_zh" not in glued)
    assert not missing, f"{lab} glues English words with no Chinese twin: {missing}"
    english = {k: words for k in twins
               if (words := english_words(_glued_words(glued[k]) or "", kept))}
    assert not english, f"{lab}: English words in Chinese glue: {english}"


def test_chinese_prose_has_no_english_words(built_book, toc_page):
    """Every Chinese page's prose (paragraphs, list items, captions, admonition titles) shows no
    Latin word outside the glossary's "Kept in English" list. Left out: code, math, lab outputs,
    citations. Glued text is scanned too (the labs glue it in the page's language)."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    kept = kept_latin()
    texts = _shown(str(built_book.zh_html / f"{toc_page}.html"))["prose"]
    english = {text[:120]: words for text in texts if (words := english_words(text, kept))}
    assert not english, f"zh {toc_page}: English words in the prose: {english}"


def test_equation_references_read_in_each_language(built_book, toc_page):
    """An equation reference reads "Eq. 2.3" in English, once ("Eq. Eq." was a source that wrote
    the prefix the role adds), and "式 (2.3)" in Chinese (_ext/i18n_edition.py)."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    pages = [built_book.html / f"{toc_page}.html", built_book.zh_html / f"{toc_page}.html"]
    english, chinese = (" ".join(_shown(str(p))["prose"]) for p in pages)
    assert not re.search(r"\b(?:Eqs?|Equations?)\.?\s+Eq\.", english), f"{toc_page}: Eq. Eq."
    assert "Eq." not in chinese, f"zh {toc_page}: an English equation reference"
    refs = (ROOT / "locales/zh_CN/LC_MESSAGES" / f"{toc_page}.po").read_text(encoding="utf-8")
    if "{eq}`" in refs:
        assert re.search(r"式 \(\d+\.\d+\)", chinese), f"zh {toc_page}: no 式 (N) reference"


def _search_index(html: Path) -> dict:
    text = (html / "searchindex.js").read_text(encoding="utf-8")
    return json.loads(text[text.index("(") + 1:text.rindex(")")])


@pytest.mark.parametrize("term, page", [("显存", "chapters/01_memory_wall"),
                                        ("梯度累积", "chapters/04_accumulation"),
                                        ("流水线并行", "chapters/06_pipeline")])
def test_chinese_search_index_has_chinese_words(built_book, term, page):
    """Sphinx's Chinese search splits words with jieba (requirements-book.txt) and the
    glossary's terms: the index holds the words a reader searches for, for the pages that use
    them."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    index = _search_index(built_book.zh_html)
    docs = []
    for kind in ("terms", "titleterms"):
        found = index[kind].get(term, [])
        docs += found if isinstance(found, list) else [found]
    assert index["docnames"].index(page) in docs, f"{term!r} does not find {page}: {docs}"


# ----------------------------------------------------------------------------- verbatim parts
def test_translations_keep_roles_code_math_and_urls():
    """A translation keeps every role's target (labels, glue names, citation keys), inline code,
    math and URL of its English message: the glued numbers and references are the same ones."""
    problems = i18n.verbatim_problems()
    assert not problems, "translations that lost or altered verbatim parts:\n" + "\n".join(problems)


def test_verbatim_parts():
    english = ("See {numref}`Figure %s <fig-zero>`, {glue:text}`zero_saving:.1f` and `shard(x)` "
               "for $2\\Psi$ (https://arxiv.org/abs/1910.02054).")
    parts = i18n.verbatim_parts(english)
    assert parts == {("{numref}", "fig-zero"), ("{glue:text}", "zero_saving:.1f"),
                     ("code", "shard(x)"), ("math", "\\Psi"),  # numerals aside
                     ("url", "https://arxiv.org/abs/1910.02054")}
    good = ("见{numref}`图 %s <fig-zero>`、{glue:text}`zero_saving:.1f` 和 `shard(x)`，"
            "对应 $2\\Psi$（https://arxiv.org/abs/1910.02054）。")
    assert parts <= i18n.verbatim_parts(good)
    bad = good.replace("zero_saving:.1f", "zero_saving")
    assert parts - i18n.verbatim_parts(bad) == {("{glue:text}", "zero_saving:.1f")}


def test_a_glue_role_in_a_translated_lab_paragraph_reads_the_lab():
    """A bare {glue:text} key, parsed outside its notebook's parse (a translated paragraph), reads
    the notebook's stored glue data: the same number in both editions."""
    glue = _load("i18n_glue", ROOT / "_ext" / "i18n_glue.py")

    class Env:
        docname = "labs/03_checkpointing"

        def doc2path(self, docname):
            return ROOT / f"{docname}.ipynb"

    class Document(dict):
        settings = type("Settings", (), {"env": Env()})()

    translated = Document()
    assert glue.own_notebook_text("ckpt_block_over_input", translated, with_format=True) == \
        "03_checkpointing.ipynb::ckpt_block_over_input:s"
    assert glue.own_notebook_text("saving:.1f", translated, with_format=True) == \
        "03_checkpointing.ipynb::saving:.1f"
    assert glue.own_notebook_text("../labs/02_zero.ipynb::x:.1f", translated) == \
        "../labs/02_zero.ipynb::x:.1f"
    parsing = Document(nb_renderer=object())  # the notebook's own parse: left alone
    assert glue.own_notebook_text("ckpt_block_over_input", parsing) == "ckpt_block_over_input"


def test_the_chinese_edition_reads_a_glued_key_s_chinese_twin():
    """In the Chinese edition a glue role or {glued-figure} naming a key whose lab also glued
    key_zh reads the twin; a number (no twin) and the English edition read the key itself."""
    glue = _load("i18n_glue", ROOT / "_ext" / "i18n_glue.py")

    class Env:
        docname = "chapters/09_planning"

        def __init__(self, language):
            self.config = type("Config", (), {"language": language})()

        def relfn2path(self, rel, docname):
            path = (ROOT / docname).parent / rel
            return rel, str(path.resolve())

    def document(language):
        return type("Document", (dict,), {"settings": type("S", (), {"env": Env(language)})()})()

    lab = "../labs/09_planning.ipynb"
    chinese, english = document("zh_CN"), document("en")
    assert glue.in_page_language(f"{lab}::pl_70b_sp:s", chinese, True) == f"{lab}::pl_70b_sp_zh:s"
    assert glue.in_page_language(f"{lab}::pl_70b_sp:s", english, True) == f"{lab}::pl_70b_sp:s"
    assert glue.in_page_language(f"{lab}::pl_70b_gb:.1f", chinese, True) == f"{lab}::pl_70b_gb:.1f"
    assert glue.chinese_key(Env("zh_CN"), lab, "pl_70b_fig") == "pl_70b_fig_zh"
    assert glue.chinese_key(Env("zh_CN"), lab, "pl_70b_fit") == "pl_70b_fit"


def test_publishing_rewrites_the_address_in_the_catalogues(tmp_path):
    """scripts/set_repo_url.py writes the new address into the catalogues too, English and
    translation, even where the catalogue wraps the URL over two lines: publishing leaves no
    translation stale."""
    sru = _load("set_repo_url_script", ROOT / "scripts" / "set_repo_url.py")
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    root = tmp_path / "course"
    root.mkdir()
    for name in ("_config.yml", "GPU_RESULTS.md"):
        shutil.copy2(ROOT / name, root / name)
    old_repo, branch = sru.read_setting(root)
    link = f"[GPU_RESULTS.md](https://github.com/{old_repo}/blob/{branch}/GPU_RESULTS.md)"
    catalog = Catalog(locale="zh_CN")
    catalog.add(f"No GPU run has been recorded here yet, as the file says: {link}.",
                f"这里还没有记录 GPU 运行，见 {link}。")
    po = root / "locales" / "zh_CN" / "LC_MESSAGES" / "GPU_RESULTS.po"
    po.parent.mkdir(parents=True)
    with open(po, "wb") as f:
        write_po(f, catalog, width=76)
    assert link not in po.read_text(encoding="utf-8")  # wrapped: a text edit would miss it
    assert sru.disagreements(root) == []
    changed = sru.set_repo_url("https://github.com/new-owner/gpu-course", "published", root)
    assert po in changed
    [message] = [m for m in i18n.read_catalogue(po) if m.id]
    new_link = "(https://github.com/new-owner/gpu-course/blob/published/GPU_RESULTS.md)"
    assert new_link in message.id and new_link in message.string, message
    assert sru.disagreements(root) == []


# ----------------------------------------------------------------------------- Chinese labs
zh_labs = _load("zh_labs_script", ROOT / "scripts" / "zh_labs.py")
LABS = sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))


def _lab_pair(lab):
    english, written = ROOT / "labs" / lab, ROOT / "labs" / "zh" / lab
    assert written.is_file(), f"labs/zh/{lab} is missing: python scripts/zh_labs.py {lab[:2]}"
    cells = [json.loads(p.read_text(encoding="utf-8"))["cells"] for p in (english, written)]
    assert [c["cell_type"] for c in cells[0]] == [c["cell_type"] for c in cells[1]]
    return list(zip(*cells))


@pytest.mark.parametrize("lab", LABS)
def test_chinese_lab_is_the_english_lab_translated(lab):
    """labs/zh/<lab>'s Markdown and code are the English lab's translated by its catalogues
    (labs/NN.po, labs/NN.code.po), nothing untranslated: token for token, the code is the
    English code except its comments and shown literals, each its catalogue translation."""
    nb, missing = zh_labs.chinese_lab(ROOT / "labs" / lab)
    assert not missing, f"{lab}: untranslated in the Chinese lab: {missing}"
    code, setups = zh_labs.code_translations(ROOT / "labs" / lab), 0
    for (en, zh), want in zip(_lab_pair(lab), nb["cells"]):
        assert "".join(zh["source"]) == "".join(want["source"]), (
            f"labs/zh/{lab} is stale: python scripts/zh_labs.py {lab[:2]}")
        if en["cell_type"] == "markdown" and re.search(r"[A-Za-z]{3}", "".join(en["source"])):
            assert re.search(r"[\u4e00-\u9fff]", "".join(zh["source"])), (
                f"labs/zh/{lab}: a Markdown cell without Chinese: {''.join(zh['source'])[:80]}")
        if en["cell_type"] != "code":
            continue
        source, chinese = "".join(en["source"]), "".join(zh["source"])
        if "labkit.setup(" in source:  # its one added argument: labkit prints in Chinese
            assert zh_labs.SETUP_LANG in chinese, f"{lab}: labkit.setup without {zh_labs.SETUP_LANG}"
            setups += 1
        ours, theirs = zh_labs._tokens(source), zh_labs._tokens(zh_labs.english_setup(chinese))
        assert [t.type for t in ours] == [t.type for t in theirs], f"{lab}: tokens moved"
        units = zh_labs.code_units(source)
        translated = {k for u in units for k in u.tokens}
        touched = {ours[k].start[0] for k in translated}  # lines whose columns may shift
        for n, (a, b) in enumerate(zip(ours, theirs)):
            if n not in translated:
                assert a.string == b.string, f"{lab}: code changed: {a.string!r} -> {b.string!r}"
                assert a.start[0] in touched or a.start == b.start, f"{lab}: {a.string!r} moved"
        for unit in units:
            pieces = [theirs[k].string for k in unit.tokens]
            if unit.kind == "literal":
                text = "".join(zh_labs._split_literal(p)[2] for p in pieces)
                assert text == code[unit.message], (lab, unit.message, text)
            else:
                # a comment block's lines joined, where its cuts fell (spaces aside)
                text = re.sub(r"\s", "", "".join(p[1:] for p in pieces))
                assert text == re.sub(r"\s", "", code[unit.message]), (lab, text)
    assert setups == 1, f"{lab}: {setups} labkit.setup calls (one, in its first cell)"


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _printed(cell) -> str:
    """What a code cell's outputs show as text: streams, results, errors, glued values."""
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append("".join(out["text"]))
        for mime, value in out.get("data", {}).items():
            if mime.endswith("text/plain"):
                parts.append("".join(value))
        if out.get("output_type") == "error":
            parts.append(out["ename"] + ": " + out["evalue"])
    return "\n".join(parts)


@pytest.mark.parametrize("lab", LABS)
def test_chinese_lab_prints_the_english_labs_numbers(lab):
    """The Chinese lab was run (scripts/zh_labs.py executes it): each code cell's outputs hold
    the English lab's numbers, in order, except in the cells the English lab marks
    nbval-ignore-output (timings, the machine): nbval's check of the English lab covers them."""
    compared = 0
    for en, zh in _lab_pair(lab):
        if en["cell_type"] != "code":
            continue
        assert bool(en.get("outputs")) == bool(zh.get("outputs")), (
            f"labs/zh/{lab}: not run? {''.join(zh['source'])[:80]}")
        if "nbval-ignore-output" in en.get("metadata", {}).get("tags", []):
            continue
        english, chinese = _printed(en), _printed(zh)
        assert _NUMBER.findall(english) == _NUMBER.findall(chinese), (
            f"labs/zh/{lab}: numbers differ from the English lab's:\n{english[:600]}\n---\n"
            f"{chinese[:600]}")
        compared += bool(_NUMBER.findall(english))
    assert compared >= 3, f"{lab}: only {compared} cells' numbers compared"


@pytest.mark.parametrize("lab", LABS)
def test_chinese_lab_prints_chinese_where_its_code_does(lab):
    """A cell whose English output shows words of its own translated literals shows the
    Chinese instead: the words are gone from the Chinese output and Chinese is there."""
    checked, code = 0, zh_labs.code_translations(ROOT / "labs" / lab)
    for en, zh in _lab_pair(lab):
        if en["cell_type"] != "code":
            continue
        english, chinese = _printed(en), _printed(zh)
        for unit in zh_labs.code_units("".join(en["source"])):
            runs = re.findall(r"[A-Za-z][A-Za-z' ]*[A-Za-z]",
                              i18n.without_fields(unit.message)) if unit.kind == "literal" else []
            words = max((r for r in runs if " " in r and zh_labs.holds_words(r)
                         and r not in code[unit.message]), key=len, default=None)
            if words and words in english:
                checked += 1
                assert words not in chinese and re.search(r"[\u4e00-\u9fff]", chinese), (
                    f"labs/zh/{lab}: {words!r} still printed in English")
    assert checked, f"{lab}: no printed literal found to check"


# What a Chinese lab may print in Latin letters besides the glossary's kept English: what its own
# code names (variables, dict keys, data labels such as "torch DDP", a preset's name), Python's
# reprs (True, <Figure ...>), and the values labkit returns that the lab prints as data (a phase, an
# option, a dict's keys, a preset's name); what a tool prints in English is not read: an engine's
# configuration (code) and the command line's output (a cell tagged "english-tool-output": its
# lines that the English lab prints the same).
_REPR = re.compile(r"<Figure size \d+x\d+ with \d+ Axes>|\b(?:True|False|None)\b|\w+Error\b|\d+(?:\.\d+)?\w*/s\b"
                   r"|\[F+\]|\b[FB]\d+\b|--[\w-]+")  # a checkpoint plan's segments, a schedule's F0, a flag


@functools.lru_cache(maxsize=None)
def _labkit_values() -> frozenset[str]:
    """The Latin words of values labkit returns that labs print as data, read from labkit."""
    from labkit.checkpoint.plan import POLICIES
    from labkit.memory.analytic import activation_bytes
    from labkit.memory.meter import CATEGORIES
    from labkit.model import get_preset
    from labkit.paged_attention.reservation import Waste
    from labkit.shapes import PRESETS
    from labkit.tensor_parallel import analytic as tp

    cfg = get_preset("tiny", dropout=0.1)
    keys = [*activation_bytes(cfg, 1).terms, *tp.model_activation_bytes(get_preset("tiny"), 1, tp_size=2).terms,
            *Waste().fractions(), *CATEGORIES, *POLICIES, "forward", "backward", "weights", "kv_cache"]
    return frozenset([w.lower() for k in keys for w in re.findall(r"[A-Za-z][A-Za-z0-9]*", k)]
                     + [name.lower() for name in PRESETS])


def _code_words(lab: str) -> set[str]:
    """The Latin words of the English lab's code outside what the Chinese lab translates (names,
    and the data its literals hold), and the symbols its translations keep from the English
    (Psi, dL/dX, F0: each in the English message and its reviewed translation)."""
    words = {w.lower() for english, chinese in zh_labs.code_translations(ROOT / "labs" / lab).items()
             for w in set(re.findall(r"[A-Za-z][A-Za-z0-9]*", chinese))
             & set(re.findall(r"[A-Za-z][A-Za-z0-9]*", english))}
    for cell in json.loads((ROOT / "labs" / lab).read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tokens = zh_labs._tokens(source)
        translated = {k for u in zh_labs.code_units(source) for k in u.tokens}
        for n, t in enumerate(tokens):
            if t.type == tokenize.NAME:  # a name whole (peak_bytes is not "peak")
                words.add(t.string.lower())
            elif n not in translated and t.type == tokenize.STRING:
                words |= {w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9]*", t.string)}
    return words


@pytest.mark.parametrize("lab", LABS)
def test_chinese_lab_prints_no_english_prose(lab):
    """Every line a Chinese lab prints, labkit's tables, reasons, notes and exceptions included,
    holds no English word but those its code names, labkit returns as data, or the glossary keeps;
    an engine's configuration and the command line's output (English by design) aside."""
    allowed = kept_latin() | _labkit_values() | _code_words(lab)
    found = []
    for en, zh in _lab_pair(lab):
        if zh["cell_type"] != "code":
            continue
        code = set(_printed(en).splitlines()) \
            if "english-tool-output" in en.get("metadata", {}).get("tags", []) else set()
        for line in _printed(zh).splitlines():
            words = [] if line in code else english_words(_REPR.sub(" ", line), allowed)
            if words:
                found.append(f"{words}: {line[:100]}")
    assert not found, f"labs/zh/{lab} prints English:\n" + "\n".join(found[:30])


def test_a_chinese_lab_draws_with_a_cjk_font_installed_after_matplotlib_started(monkeypatch, capsys):
    """labkit.setup(lang="zh_CN") gives matplotlib the CJK font, also one installed after
    matplotlib listed its fonts (apt-get on Colab, then the cell run again); with none, it says
    how to install one instead of drawing boxes silently."""
    import glob

    import matplotlib
    from matplotlib import font_manager

    import labkit
    from labkit import book, messages

    if not glob.glob(book.CJK_FONT_FILES):
        if os.environ.get("CI") == "true":
            pytest.fail("fonts-noto-cjk is not installed: .ci/run installs it")
        pytest.skip("fonts-noto-cjk is not installed (apt-get install fonts-noto-cjk)")
    fm = font_manager.fontManager
    monkeypatch.setattr(fm, "ttflist", [f for f in fm.ttflist if "CJK" not in f.name])
    monkeypatch.setitem(matplotlib.rcParams, "font.family", list(matplotlib.rcParams["font.family"]))
    fm._findfont_cached.cache_clear()
    previous = messages.current()
    try:
        labkit.setup(lang="zh_CN")
        assert matplotlib.rcParams["font.family"] == ["DejaVu Sans", book.CJK_FONTS[0]]
        assert messages.render("setup.no_cjk_font", "zh_CN", command="!apt-get -qq install fonts-noto-cjk") not in capsys.readouterr().out
        monkeypatch.setattr(book, "CJK_FONT_FILES", "/nonexistent/*.ttc")
        monkeypatch.setattr(book, "CJK_FONTS", ["No Such CJK Font", "DejaVu Sans"])
        labkit.setup(lang="zh_CN")
        assert messages.render("setup.no_cjk_font", "zh_CN", command="!apt-get -qq install fonts-noto-cjk") in capsys.readouterr().out
    finally:
        messages.use(previous)
        fm._findfont_cached.cache_clear()


def test_chinese_lab_pages_open_the_chinese_labs(built_book):
    """A Chinese lab page's Colab and download buttons open labs/zh/<lab> (_ext/chinese_labs.py),
    which the build serves; the English page's open the English lab."""
    assert built_book.returncode == 0, f"book build failed:\n{built_book.log[-6000:]}"
    for lab in LABS:
        page = f"labs/{Path(lab).stem}.html"
        english = (built_book.html / page).read_text(encoding="utf-8")
        chinese = (built_book.zh_html / page).read_text(encoding="utf-8")
        colab = r'href="https://colab\.research\.google\.com/github/[^"]*/blob/[^"]*/labs/%s"'
        assert re.search(colab % re.escape(lab), english), f"{page}: no Colab link to {lab}"
        assert re.search(colab % re.escape(f"zh/{lab}"), chinese), (
            f"zh {page}: its Colab link does not open labs/zh/{lab}")
        assert f"_sources/labs/zh/{lab}" in chinese, f"zh {page}: no download of labs/zh/{lab}"
        assert (built_book.zh_html / "_sources" / "labs" / "zh" / lab).is_file()


def test_the_chinese_search_index_splits_and_stems_as_sphinxs_own():
    """_ext/zh_search.py answers "is this a Latin word of the book" from a set instead of
    scanning a list: on the Chinese text of three chapters, fed page by page as Sphinx feeds
    them, every word splits and stems as with Sphinx's own SearchChinese."""
    from babel.messages.pofile import read_po
    from sphinx.search.zh import SearchChinese

    zh_search = _load("zh_search", ROOT / "_ext" / "zh_search.py")
    ours, sphinxs = zh_search.LinearSearchChinese({}), SearchChinese({})
    sphinxs.latin_terms = []  # its own, as in a build's process (the class's list is shared)
    stemmed = 0
    for page in ("01_memory_wall", "05_tensor_parallel", "10_context_parallel"):
        with open(ROOT / "locales" / "zh_CN" / "LC_MESSAGES" / "chapters" / f"{page}.po", "rb") as f:
            text = "\n".join(m.string for m in read_po(f) if m.id and m.string)
        text += "\nwas has its"  # Latin words whose stem is shorter than 3: kept whole
        words = ours.split(text)
        assert words == sphinxs.split(text), page
        got = [ours.stem(w) for w in words]
        assert got == [sphinxs.stem(w) for w in words], page
        stemmed += sum(w.isascii() and len(w) >= 3 and s == w.lower() != sphinxs.stemmer.stemWord(w.lower())
                       for w, s in zip(words, got))
    assert stemmed > 0  # some Latin words kept whole, the branch the list decides
