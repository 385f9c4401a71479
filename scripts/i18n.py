"""Keep the Chinese edition's gettext catalogues in step with the English sources.

    python scripts/i18n.py update   # new English messages into the .po files (changed ones fuzzy)
    python scripts/i18n.py status   # per catalogue: translated / untranslated / fuzzy / obsolete
    python scripts/i18n.py check    # exit status 1 unless every message is translated and current

The catalogues are ``locales/zh_CN/LC_MESSAGES/<page>.po``, one per page of the book (Sphinx's
gettext builder, ``gettext_compact: false``), plus ``exercises/notebooks.po`` for the exercise
notebooks' instructions (their Markdown cells, one message per paragraph; the Chinese notebooks in
exercises/student/zh/ are made from it by ``scripts/exercises.py build``), and
``labs/NN_name.code.po`` per lab for its code cells' comments and printed literals (extracted by
scripts/zh_labs.py, which writes the Chinese labs from them).

Every command first regenerates the message templates (.pot) from the current English sources
into a temporary folder (a gettext build of the book: a few seconds). ``update`` merges them into
the .po files as ``sphinx-intl update`` does (babel's merge: a message whose English changed
keeps its old translation marked fuzzy; one that left the English becomes obsolete). ``check``
fails when a message of a template has no translation, a translation is fuzzy, a catalogue holds
an obsolete message or one the template no longer has, or a catalogue is missing or has no
template, when a translation breaks the glossary (locales/zh_CN/GLOSSARY.md: a listed English
term whose Chinese term is missing, a forbidden variant, a display equation's ``\text{}`` against
the glossary's rule), when Sphinx would drop it (it starts like a list item: "1. ", "+ "), and
when it loses what must stay verbatim (a role's target, inline code, math, a URL), and when a
code message's translation changes its format fields ({x:.2f}, {name}); it prints the
translated share.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANGUAGE = "zh_CN"
LOCALE_DIR = ROOT / "locales" / LANGUAGE / "LC_MESSAGES"
STUDENT_DIR = ROOT / "exercises" / "student"
NOTEBOOKS_DOMAIN = "exercises/notebooks"  # the exercise notebooks' catalogue, beside the pages'
# A lab's code catalogue, labs/NN_name.code.po beside its page's: the comments and printed
# literals of its code cells (scripts/zh_labs.py extracts them and writes the Chinese labs).
CODE_SUFFIX = ".code"
# A Markdown block that carries no prose: a rule, a fenced code block, a display equation.
_NO_PROSE = re.compile(r"\A(?:-{3,}|\*{3,}|```.*```|\$\$.*\$\$)\Z", re.S)


# ----------------------------------------------------------------------------- notebooks
def markdown_blocks(text: str) -> list[str]:
    """A Markdown cell's paragraphs (blocks separated by blank lines; a fenced code block whole)."""
    blocks, current, fenced = [], [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not line.strip() and not fenced:
            if current:
                blocks.append("\n".join(current))
            current = []
        else:
            current.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks


def is_message(block: str) -> bool:
    """Whether a block is prose to translate (rules, code and display math are not)."""
    return not _NO_PROSE.match(block.strip())


def _cell_text(cell: dict) -> str:
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def notebook_messages(student_dir: Path = STUDENT_DIR) -> list[tuple[str, str]]:
    """(message, "notebook:cell id") for every prose paragraph of the student notebooks'
    Markdown cells, in order."""
    found = []
    for path in sorted(Path(student_dir).glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                found += [(b, f"{path.name}:{cell.get('id', '')}")
                          for b in markdown_blocks(_cell_text(cell)) if is_message(b)]
    return found


def translate_notebook(nb: dict, translations: dict[str, str]) -> tuple[dict, list[str]]:
    """A copy of notebook ``nb`` whose Markdown paragraphs are replaced by their translations
    (code cells, outputs and metadata untouched); also the paragraphs that had none."""
    out = json.loads(json.dumps(nb))
    missing = []
    for cell in out["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        blocks = []
        for block in markdown_blocks(_cell_text(cell)):
            if is_message(block) and not translations.get(block):
                missing.append(block)
            blocks.append(translations.get(block) or block if is_message(block) else block)
        text = "\n\n".join(blocks)
        cell["source"] = text.splitlines(keepends=True)
    out.setdefault("metadata", {})["language"] = LANGUAGE
    return out, missing


def read_catalogue(path: Path):
    from babel.messages.pofile import read_po

    with open(path, "rb") as f:
        return read_po(f, charset="utf-8")


def translations_of(po_path: Path) -> dict[str, str]:
    """{English: Chinese} of a catalogue's translated, non-fuzzy messages."""
    if not po_path.is_file():
        return {}
    return {m.id: m.string for m in read_catalogue(po_path)
            if m.id and m.string and not m.fuzzy}


def write_notebook_template(pot: Path, student_dir: Path = STUDENT_DIR) -> None:
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    catalog = Catalog(project="Breaking the GPU Memory Wall", version="", charset="utf-8",
                      fuzzy=False)
    for message, where in notebook_messages(student_dir):
        catalog.add(message, auto_comments=[where] if message not in catalog else [])
    pot.parent.mkdir(parents=True, exist_ok=True)
    with open(pot, "wb") as f:
        write_po(f, catalog, width=76, omit_header=False)


# ----------------------------------------------------------------------------- templates
def make_templates(pot_dir: Path, source: Path = ROOT) -> Path:
    """Write every .pot of the book (gettext builder) and of the notebooks under ``pot_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build",
               str(source), "--all", "--builder", "custom", "--custom-builder", "gettext",
               "--path-output", tmp]
        proc = subprocess.run(cmd, cwd=source, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("the gettext build failed:\n" + (proc.stdout + proc.stderr)[-4000:])
        built = Path(tmp) / "_build" / "gettext"
        for pot in built.rglob("*.pot"):
            target = pot_dir / pot.relative_to(built)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(pot.read_bytes())
    write_notebook_template(pot_dir / f"{NOTEBOOKS_DOMAIN}.pot", source / "exercises" / "student")
    _zh_labs().write_code_templates(pot_dir, source / "labs")
    return pot_dir


def _zh_labs():
    """scripts/zh_labs.py, loaded by path (scripts/ is not a package)."""
    import importlib.util

    if "zh_labs_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("zh_labs_script",
                                                      ROOT / "scripts" / "zh_labs.py")
        module = sys.modules["zh_labs_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["zh_labs_script"]


# ----------------------------------------------------------------------------- code messages
# A format field of a code message ({x:.2f}, {}, {name}); "{{" and "}}" are literal braces.
_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def is_code_catalogue(name: str) -> bool:
    return name.endswith(CODE_SUFFIX)


def placeholders(text: str) -> list[str]:
    """A code message's format fields in order ({x:.2f}, {}, {name}); a quoted string inside a
    field (f"{'step':<6}") is words, which the translation may change, so it reads '…'."""
    return [_QUOTED.sub("'…'", f) for f in _FIELD.findall(text) if f not in ("{{", "}}")]


def without_fields(text: str) -> str:
    """A code message with its format fields (code: names, specs) each replaced by a space."""
    return _FIELD.sub(" ", text)


def placeholder_problems(locale_dir: Path = LOCALE_DIR) -> list[str]:
    """'catalogue: ...' for every code translation whose format fields are not the English's,
    in the same order (a field renamed, lost, added or moved would print something else)."""
    problems = []
    for po in sorted(Path(locale_dir).rglob(f"*{CODE_SUFFIX}.po")):
        name = po.relative_to(locale_dir).with_suffix("").as_posix()
        for m in read_catalogue(po):
            if m.id and m.string and not m.fuzzy and placeholders(m.id) != placeholders(m.string):
                problems.append(f"{name}: format fields {placeholders(m.string)} differ from the "
                                f"English {placeholders(m.id)}: {_short(m.string)}")
    return problems


# ----------------------------------------------------------------------------- checking
@dataclass
class Counts:
    """One catalogue against its template."""
    name: str
    total: int = 0
    translated: int = 0
    untranslated: list[str] = field(default_factory=list)
    fuzzy: list[str] = field(default_factory=list)
    obsolete: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # in the .po, no longer in the template
    problem: str = ""  # the catalogue or its template is missing

    @property
    def ok(self) -> bool:
        return not (self.untranslated or self.fuzzy or self.obsolete or self.stale
                    or self.problem)


def compare(pot_dir: Path, locale_dir: Path = LOCALE_DIR) -> list[Counts]:
    """Every catalogue of ``locale_dir`` against its template in ``pot_dir``."""
    pots = {p.relative_to(pot_dir).with_suffix("").as_posix(): p for p in pot_dir.rglob("*.pot")}
    pos = {p.relative_to(locale_dir).with_suffix("").as_posix(): p
           for p in locale_dir.rglob("*.po")}
    results = []
    for name in sorted(set(pots) | set(pos)):
        counts = Counts(name)
        if name not in pos:
            counts.problem = "no catalogue (run scripts/i18n.py update)"
        elif name not in pots:
            counts.problem = "no English page has this catalogue (delete it)"
        if counts.problem:
            results.append(counts)
            continue
        template = read_catalogue(pots[name])
        po = read_catalogue(pos[name])
        wanted = {m.id for m in template if m.id}
        counts.total = len(wanted)
        for m in po:
            if not m.id:
                continue
            if m.id not in wanted:
                counts.stale.append(m.id)
            elif not m.string:
                counts.untranslated.append(m.id)
            elif m.fuzzy:
                counts.fuzzy.append(m.id)
            else:
                counts.translated += 1
        counts.untranslated += sorted(wanted - {m.id for m in po if m.id})
        counts.obsolete = [m.id for m in po.obsolete.values()]
        results.append(counts)
    return results


def share(results: list[Counts]) -> tuple[int, int]:
    return sum(c.translated for c in results), sum(c.total for c in results)


def _short(message) -> str:
    text = message if isinstance(message, str) else str(message)
    text = " ".join(text.split())
    return text[:90] + ("..." if len(text) > 90 else "")


def report(results: list[Counts], details: bool) -> str:
    lines = [f"{'catalogue':<32} {'done':>5} {'of':>5} {'untr.':>6} {'fuzzy':>6} {'obs.':>5} "
             f"{'stale':>6}"]
    for c in results:
        lines.append(f"{c.name:<32} {c.translated:>5} {c.total:>5} {len(c.untranslated):>6} "
                     f"{len(c.fuzzy):>6} {len(c.obsolete):>5} {len(c.stale):>6}"
                     + (f"  {c.problem}" if c.problem else ""))
    done, total = share(results)
    lines.append(f"translated: {done} of {total} messages ({100 * done / max(total, 1):.1f}%)")
    if details:
        for c in results:
            for kind in ("untranslated", "fuzzy", "obsolete", "stale"):
                for message in getattr(c, kind):
                    lines.append(f"  {c.name}: {kind}: {_short(message)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- glossary
GLOSSARY = ROOT / "locales" / LANGUAGE / "GLOSSARY.md"
# What a message shows verbatim in both languages, left out before looking for a term: roles
# with their targets, inline code, math, URLs, TeX commands with their argument (a display
# equation is a message of its own).
_VERBATIM = re.compile(r"\{[\w:-]+\}`[^`]*`|``[^`]*``|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$|https?://\S+"
                       r"|\\[a-zA-Z]+\{[^{}]*\}", re.S)  # ... and TeX such as \text{bubble}


def glossary(path: Path = GLOSSARY) -> dict[str, str]:
    """{English term: Chinese term} from the glossary's table (rows ``| English | 中文 |``)."""
    terms = {}
    for line in _section(path, None).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) == 2 and re.search(r"[A-Za-z]", cells[0]):
            if cells[0].lower() != "english":
                terms[cells[0]] = cells[1]
    return terms


def term_pattern(term: str) -> re.Pattern:
    """The glossary's matching rule: case-insensitive, whole words, an -s/-es/-ed/-ing ending
    allowed, a hyphen and a space interchangeable."""
    words = [re.escape(w) for w in re.split(r"[-\s]+", term.strip())]
    return re.compile(r"(?<![\w-])" + r"[-\s]+".join(words) + r"(?:s|es|ed|ing)?(?![\w-])",
                      re.I)


def glossary_problems(locale_dir: Path = LOCALE_DIR, path: Path = GLOSSARY) -> list[str]:
    """'catalogue: English term -> Chinese term missing: message' for every translated message
    whose English uses a listed term and whose translation lacks the glossary's Chinese term."""
    patterns = {term: (term_pattern(term), zh) for term, zh in glossary(path).items()}
    problems = []
    for po in sorted(locale_dir.rglob("*.po")):
        name = po.relative_to(locale_dir).with_suffix("").as_posix()
        for m in read_catalogue(po):
            if not (m.id and m.string) or m.fuzzy:
                continue
            english = _VERBATIM.sub(" ", without_fields(m.id) if is_code_catalogue(name) else m.id)
            # Longest terms first: a term inside a longer one that the translation keeps
            # ("GPU memory" in "GPU memory wall", 内存墙) is not looked for again.
            for term, (pattern, zh) in sorted(patterns.items(), key=lambda t: -len(t[0])):
                if pattern.search(english) and zh not in m.string:
                    problems.append(f"{name}: {term!r} -> {zh!r} missing: {_short(m.string)}")
                elif zh in m.string:
                    english = pattern.sub(" ", english)
    return problems


def _section(path: Path, heading: str | None) -> str:
    """The glossary's text under ``## heading`` (up to the next ``## ``); with None, the text
    before the first ``## `` heading (the term table)."""
    parts = re.split(r"^## +(.+?)\s*$", path.read_text(encoding="utf-8"), flags=re.M)
    if heading is None:
        return parts[0]
    sections = dict(zip(parts[1::2], parts[2::2]))
    return next(body for title, body in sections.items() if title.startswith(heading))


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in ``text``, split on unescaped ``|``."""
    rows = []
    for line in text.splitlines():
        if not line.lstrip().startswith("|") or re.fullmatch(r"[\s|:-]+", line):
            continue
        cells = [c.strip().replace(r"\|", "|")
                 for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows.append(cells)
    return rows[1:]  # the header row aside


def _forbidden_rows(path: Path = GLOSSARY) -> list[list[str]]:
    """The glossary's "Forbidden variants" rows: pattern, an example it rejects, what to use."""
    return [row for row in _table_rows(_section(path, "Forbidden variants"))
            if row and row[0].startswith("`")]


def forbidden_variants(path: Path = GLOSSARY) -> dict[str, str]:
    """{regular expression: what to use instead} from the glossary's "Forbidden variants"."""
    return {row[0].strip("`"): row[2] for row in _forbidden_rows(path)}


def forbidden_examples(path: Path = GLOSSARY) -> dict[str, str]:
    """{regular expression: the example text the glossary says it rejects}."""
    return {row[0].strip("`"): row[1] for row in _forbidden_rows(path)}


def kept_english(path: Path = GLOSSARY) -> set[str]:
    """The Latin words a Chinese page may show (lower case), from the glossary's "Kept in
    English" block."""
    block = re.search(r"```text\n(.*?)```", _section(path, "Kept in English"), re.S).group(1)
    return {w.lower() for w in block.split()}


def prose_of(text: str) -> str:
    """``text`` with its verbatim parts (roles, code, math, URLs, TeX) each replaced by ``N``."""
    return _VERBATIM.sub("N", text)


def forbidden_in(text: str, variants: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(what matched, what to use instead) for every forbidden variant in ``text``'s prose."""
    variants = forbidden_variants() if variants is None else variants
    prose = prose_of(text)
    return [(m.group(0), instead) for pattern, instead in variants.items()
            for m in re.finditer(pattern, prose)]


def forbidden_problems(locale_dir: Path = LOCALE_DIR, path: Path = GLOSSARY) -> list[str]:
    """'catalogue: forbidden 'x' (use y): message' for every forbidden variant in a translation."""
    variants = forbidden_variants(path)
    problems = []
    for po in sorted(Path(locale_dir).rglob("*.po")):
        name = po.relative_to(locale_dir).with_suffix("").as_posix()
        for m in read_catalogue(po):
            if m.id and m.string and not m.fuzzy:
                text = without_fields(m.string) if is_code_catalogue(name) else m.string
                problems += [f"{name}: forbidden {found!r} (use {instead}): {_short(m.string)}"
                             for found, instead in forbidden_in(text, variants)]
    return problems


# A translation whose text starts like a list item, a quote or a heading parses as one, and
# Sphinx then silently keeps the English (it only takes a translation that parses as a
# paragraph). A heading "1. Memory" must be translated "1\. 显存". (The exercise notebooks'
# catalogue holds whole Markdown blocks, where a list is a list.)
_BLOCK_START = re.compile(r"\A(?:\d+[.)]|[-+*>]|#{1,6})(?:\s|\Z)")


def dropped_problems(locale_dir: Path = LOCALE_DIR) -> list[str]:
    """'catalogue: ...' for every translation that Sphinx would drop (it starts like a block)."""
    problems = []
    for po in sorted(Path(locale_dir).rglob("*.po")):
        name = po.relative_to(locale_dir).with_suffix("").as_posix()
        if name == NOTEBOOKS_DOMAIN or is_code_catalogue(name):  # not Sphinx's: nothing drops
            continue
        for m in read_catalogue(po):
            if m.id and m.string and not m.fuzzy and _BLOCK_START.match(m.string):
                problems.append(f"{name}: starts like a list item or heading, so Sphinx would "
                                f"show the English (escape it: 1\\. …): {_short(m.string)}")
    return problems


# Display math: a \text{} right after _ or ^ is a symbol's name and stays English; any other
# \text{} is prose and is translated (GLOSSARY.md, "Display math").
_SYMBOL_TEXT = re.compile(r"[_^]\\text\{([^{}]*)\}")
_PROSE_TEXT = re.compile(r"(?<![_^])\\text\{([^{}]*)\}")
_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-/'’][A-Za-z0-9]+)*")


def is_display_math(message: str) -> bool:
    """Whether a message is a display equation (TeX outside any $...$ and code)."""
    return bool(re.search(r"\\[a-zA-Z]+", _CODE.sub(" ", _MATH.sub(" ", message)))) \
        and "$" not in message


def math_text_problems(locale_dir: Path = LOCALE_DIR, path: Path = GLOSSARY) -> list[str]:
    """'catalogue: ...' for every display equation whose translation changes a symbol's
    ``\\text{}`` subscript or leaves a prose ``\\text{}`` in English."""
    from collections import Counter

    kept = kept_english(path)
    problems = []
    for po in sorted(Path(locale_dir).rglob("*.po")):
        name = po.relative_to(locale_dir).with_suffix("").as_posix()
        for m in read_catalogue(po):
            if not (m.id and m.string and not m.fuzzy and is_display_math(m.id)):
                continue
            if Counter(_SYMBOL_TEXT.findall(m.id)) != Counter(_SYMBOL_TEXT.findall(m.string)):
                problems.append(f"{name}: a symbol's \\text{{}} subscript must stay as in the "
                                f"English: {_short(m.string)}")
            english = [w for x in _PROSE_TEXT.findall(m.string) for w in _LATIN_WORD.findall(x)
                       if w.lower() not in kept]
            if english:
                problems.append(f"{name}: \\text{{}} left in English {english}: "
                                f"{_short(m.string)}")
    return problems


# ----------------------------------------------------------------------------- verbatim parts
_ROLE = re.compile(r"\{([\w:.-]+)\}`([^`]*)`")
_CODE = re.compile(r"``([^`]+)``|`([^`]+)`")
_MATH = re.compile(r"\$\$(.+?)\$\$|\$([^$]+)\$", re.S)
_URL = re.compile(r"https?://[^\s)>\]`\u0080-\uffff]+")  # stops at CJK punctuation
# A role whose target a translation may change: a download may give the Chinese file.
_FREE_ROLES = {"download"}


def _math_key(tex: str) -> str:
    """Math compared without its numerals: "8.6" billion may become 86 亿, the symbols may not
    change."""
    return re.sub(r"[\d.,]|\{,\}|\s", "", tex)


def verbatim_parts(text: str) -> set[tuple[str, str]]:
    """What a translation must show as the English does: each role with its target (the part in
    <...>, else its content: a label, a glue name, a citation key), inline code, math, URLs."""
    parts = set()
    for name, content in _ROLE.findall(text):
        target = re.search(r"<([^<>]*)>\s*$", content)
        if name not in _FREE_ROLES:
            parts.add((f"{{{name}}}", (target.group(1) if target else content).strip()))
    rest = _ROLE.sub(" ", text)
    parts |= {("code", " ".join((a or b).split())) for a, b in _CODE.findall(rest)}
    parts |= {("math", _math_key(a or b)) for a, b in _MATH.findall(_CODE.sub(" ", rest))}
    parts |= {("url", u.rstrip(".,;:")) for u in _URL.findall(text)}
    return parts


def verbatim_problems(locale_dir: Path = LOCALE_DIR) -> list[str]:
    """'catalogue: missing <part>: message' for every translation that lost or altered a role's
    target, inline code, math or a URL of its English message."""
    problems = []
    for po in sorted(locale_dir.rglob("*.po")):
        name = po.relative_to(locale_dir).with_suffix("").as_posix()
        for m in read_catalogue(po):
            if m.id and m.string and not m.fuzzy:
                lost = sorted(verbatim_parts(m.id) - verbatim_parts(m.string))
                problems += [f"{name}: {kind} {part!r} missing in: {_short(m.string)}"
                             for kind, part in lost]
    return problems


# ----------------------------------------------------------------------------- rewriting links
def rewrite_catalogue(path: Path, rewrite) -> bool:
    """Apply ``rewrite`` (str -> str) to every message of a catalogue, English and translation
    alike, keeping the messages' order and flags; return whether anything changed. A text edit
    of the file would miss a URL that the catalogue wraps over two lines.
    (scripts/set_repo_url.py rewrites the repository's address this way.)"""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    old = read_catalogue(path)
    new = Catalog(locale=old.locale, header_comment=old.header_comment, charset="utf-8",
                  fuzzy=old.fuzzy)
    new.mime_headers = old.mime_headers
    changed = False
    for m in old:
        if not m.id:
            continue
        msgid, msgstr = rewrite(m.id), rewrite(m.string) if m.string else m.string
        changed |= (msgid, msgstr) != (m.id, m.string)
        new.add(msgid, msgstr, locations=m.locations, flags=m.flags,
                auto_comments=m.auto_comments, user_comments=m.user_comments,
                previous_id=m.previous_id, context=m.context)
    new.obsolete = old.obsolete
    if changed:
        with open(path, "wb") as f:
            write_po(f, new, width=76)
    return changed


def catalogue_texts(locale_root: Path) -> dict[Path, list[str]]:
    """{catalogue: its messages' English and translations} under ``locale_root``."""
    return {po: [t for m in read_catalogue(po) if m.id for t in (m.id, m.string) if t]
            for po in sorted(Path(locale_root).rglob("*.po"))}


# ----------------------------------------------------------------------------- commands
def update(pot_dir: Path, locale_dir: Path = LOCALE_DIR) -> None:
    """Merge the templates into the catalogues as ``sphinx-intl update`` does."""
    from sphinx_intl.basic import update as intl_update

    intl_update(str(locale_dir.parent.parent), str(pot_dir), (LANGUAGE,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("command", choices=("update", "status", "check"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pot_dir = make_templates(Path(tmp))
        if args.command == "update":
            update(pot_dir)
        results = compare(pot_dir)
    print(report(results, details=args.command == "check"))
    terms = (glossary_problems() + forbidden_problems() + dropped_problems()
             + math_text_problems() + verbatim_problems() + placeholder_problems())
    if args.command == "check" and terms:
        print(f"\n{len(terms)} translations break the glossary ({GLOSSARY.relative_to(ROOT)}) or "
              "lose a role, code, math or a URL of the English:")
        print("\n".join("  " + t for t in terms))
    if args.command == "check" and (terms or not all(c.ok for c in results)):
        print("\nThe Chinese edition is not complete or not current: translate the messages "
              "above (scripts/i18n.py status).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
