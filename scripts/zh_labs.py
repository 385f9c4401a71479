"""Write the Chinese lab notebooks, labs/zh/NN_name.ipynb, from the English ones and the catalogues.

    python scripts/zh_labs.py [LAB ...]     # default: every lab; LAB is a name or its number

Markdown: every heading, paragraph, list item and table cell replaced by its translation in
locales/zh_CN/LC_MESSAGES/labs/NN_name.po, the catalogue of the Chinese lab page (relative links
gain a ../; the exercises' Colab links open exercises/student/zh/). Code: the same code, token
for token, except its comments and the string literals it prints or draws (print() arguments,
f-strings and .format templates that reach them, plot titles, axis and tick labels, legends,
label= keywords), each replaced by its translation in labs/NN_name.code.po (extracted here with
``tokenize`` and ``ast``; scripts/i18n.py writes its template and checks it, format fields kept).
Tool markers (# NBVAL_..., # noqa), shapes such as ``# (B, T, h)`` and data (dict keys, names,
arguments, paths) stay. Then the notebook is run as the English labs are (nbconvert, from labs/;
its labkit.setup(lang="zh_CN") gives matplotlib a CJK font behind DejaVu Sans), so its outputs
are what its code prints, the English lab's numbers (tests/test_i18n.py checks them, and that
nothing else moved).
A literal bound to a name that the cell only prints (``line = f"..."``, a loop's label) counts as
printed. The Chinese lab's ``labkit.setup(...)`` call gains ``lang="zh_CN"`` (its one other change),
so what labkit prints is in Chinese too: its tables, reasons and notes, the meter's table, the
exceptions a lab shows (labkit.messages). What stays English: the values labkit returns and the
lab prints (phase names such as "backward", option values such as "selective", a plan's repr),
an engine's configuration (code), the command line's output, and labels the lab takes from data
(dict values such as "torch DDP", legend entries named by dict keys).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import json
import re
import sys
import time
import tokenize
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
ZH_LABS = LABS / "zh"


def _i18n():
    if "i18n_script" not in sys.modules:  # scripts/ is not a package: load scripts/i18n.py by path
        spec = importlib.util.spec_from_file_location("i18n_script", ROOT / "scripts" / "i18n.py")
        module = sys.modules["i18n_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["i18n_script"]


def _message(text: str) -> str:
    """A block's text as Sphinx's gettext writes its message: line breaks become spaces."""
    return " ".join(line.strip() for line in text.split("\n")).strip()


def translate_markdown(text: str, translations: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` (one Markdown cell) with each heading, paragraph and table cell translated;
    and the messages that have no translation. List markers, heading marks and indentation stay."""
    from markdown_it import MarkdownIt

    lines = text.split("\n")
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    missing, replaced = [], {}
    for i, token in enumerate(tokens):
        if token.type != "inline" or not token.content.strip():
            continue
        parent = tokens[i - 1]
        message = _message(token.content)
        if message.startswith("$$") and message.endswith("$$"):  # display math, no prose
            continue
        chinese = translations.get(message)
        if not chinese:
            missing.append(message)
            continue
        start, end = parent.map if parent.map else (None, None)
        if parent.type in ("th_open", "td_open") or start is None:
            row = next(n for n in range(len(lines)) if token.content.strip() in lines[n]) \
                if start is None else start
            lines[row] = lines[row].replace(token.content.strip(), chinese, 1)
            continue
        first = token.content.split("\n")[0].strip()
        prefix = lines[start][:lines[start].find(first)] if first in lines[start] else ""
        replaced[start] = (end, prefix + chinese)
    out, n = [], 0
    while n < len(lines):
        if n in replaced:
            end, line = replaced[n]
            out.append(line)
            n = end
        else:
            out.append(lines[n])
            n += 1
    return _relink("\n".join(out)), missing


def _relink(text: str) -> str:
    """Links as seen from labs/zh/: relative ones one folder further up, the exercises' Colab
    links to the Chinese exercise notebooks (exercises/student/zh/)."""
    text = re.sub(r"\]\((\.\./)", r"](../\1", text)
    return re.sub(r"(/exercises/student/)(?!zh/)(\w+\.ipynb)", r"\1zh/\2", text)


# ----------------------------------------------------------------------------- code cells
# What a reader of a lab's code reads: its comments, and the string literals it prints or draws.
# A *unit* is one message: a block of full-line comments (one sentence over several lines), a
# comment after code, or a string literal (an implicit concatenation over several lines whole).
# Its translation is cut back into as many pieces as the English had lines, so the code keeps
# its tokens, lines and layout; only the text of the COMMENT and STRING tokens changes.
_MARKER = re.compile(r"#\s*(?:NBVAL|noqa|type:|pragma|%%)|#!")  # tool markers stay as they are
_WORD = re.compile(r"[A-Za-z]+")
_SHAPE = re.compile(r"\([\w\s,*/+.-]*\)\Z")  # a comment that is a tensor's shape: (nh, L, hs)
# Calls whose arguments a reader sees: printed, or drawn as a figure's title, axis label, tick
# label, text or legend; and the keywords that label a plotted series.
_SHOW_FUNCS = {"print", "display"}
_SHOW_METHODS = {"set_title", "set_xlabel", "set_ylabel", "suptitle", "title", "xlabel", "ylabel",
                 "text", "annotate", "set_xticklabels", "set_yticklabels", "legend", "figtext"}
_TICKS = {"set_xticks", "set_yticks", "xticks", "yticks"}  # their labels, after the positions
_SHOW_KEYWORDS = {"label", "labels", "title"}
# An expression a shown literal may sit in: joined, formatted, chosen, listed.
_PASS_THROUGH = (ast.BinOp, ast.JoinedStr, ast.FormattedValue, ast.IfExp, ast.Tuple, ast.List,
                 ast.BoolOp, ast.Starred, ast.GeneratorExp, ast.ListComp)  # a comprehension's item
_STR_METHODS = {"format", "join", "ljust", "rjust", "center"}


@dataclass(frozen=True)
class Unit:
    """One message of a code cell: its kind ("comment" or "literal"), the token indices it
    spans, and the English message (a literal's text between its quotes, as written)."""
    kind: str
    tokens: tuple[int, ...]
    message: str


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def _python(source: str) -> str:
    """``source`` with its IPython magics (``%pip ...``) blanked, for ``ast``."""
    return re.sub(r"(?m)^(\s*)%.*$", lambda m: m.group(1) + "pass", source)


def holds_words(text: str) -> bool:
    """Whether a literal's text (its f-string fields aside) has an English word a Chinese reader
    would need translated: one of two letters or more outside the glossary's kept English."""
    kept, i18n = _kept(), _i18n()
    quoted = [q for f in i18n._FIELD.findall(text)  # {'step':<6} is words; {r['loss']} data
              for q in re.findall(r"(?<![\[\w])\s*('[^']*'|\"[^\"]*\")", f)]
    return any(len(w) > 1 and w.lower() not in kept
               for w in _WORD.findall(" ".join([i18n.without_fields(text)] + quoted)))


def _reaches_a_reader(node: ast.AST, parents: dict) -> bool:
    """Whether ``node``'s value is shown: it sits in the arguments of a call that prints or draws
    text (or a ``label=``-like keyword), through joins, f-strings, ``.format`` and choices."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.keyword):
            return parent.arg in _SHOW_KEYWORDS
        if isinstance(parent, ast.Call):
            func = parent.func
            if child is func:
                return False
            if isinstance(func, ast.Attribute) and func.value is child:
                if func.attr in _STR_METHODS:  # "a {}".format(x): the template goes on
                    child, parent = parent, parents.get(parent)
                    continue
                return False
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else None
            if name in _SHOW_FUNCS or isinstance(func, ast.Attribute) and (
                    name in _SHOW_METHODS or name in _TICKS and child in parent.args[1:]):
                return True
            if isinstance(func, ast.Attribute) and name in _STR_METHODS \
                    and child in parent.args:  # ", ".join([...]): goes on
                child, parent = parent, parents.get(parent)
                continue
            return False
        if isinstance(parent, ast.FormattedValue) and child is parent.format_spec:
            return False
        if not isinstance(parent, _PASS_THROUGH):
            return False
        child, parent = parent, parents.get(parent)
    return False


def _shown_names(tree: ast.AST, parents: dict) -> set[str]:
    """The names whose value a cell only shows (``print(line)``, ``f"{name}: ..."`` printed),
    used nowhere else in it (a key, an argument), so a translated value changes no result."""
    loads = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
             and not _glued(node, parents)]
    shown = {node.id for node in loads if _reaches_a_reader(node, parents)}
    return shown - {node.id for node in loads if not _reaches_a_reader(node, parents)}


def _glued(node: ast.AST, parents: dict) -> bool:
    """Whether ``node`` is an argument of ``glue(...)``: the value the English page shows (its
    Chinese is the call's ``zh=``), neither a result nor something the Chinese lab prints."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "glue":
            return True
    return False


def _bound_to_shown_name(node: ast.AST, parents: dict, names: set[str]) -> bool:
    """Whether ``node`` is (part of) the value bound to a shown name: ``line = f"..."``,
    ``line += "..."``, or the item of a loop's tuples that a shown loop variable takes
    (``for name, x in (("the fastest", a), ...)``)."""
    child, parent, position = node, parents.get(node), None
    while isinstance(parent, _PASS_THROUGH):
        if isinstance(parent, ast.FormattedValue) and child is parent.format_spec:
            return False
        if isinstance(parent, ast.Tuple) and position is None:
            position = parent.elts.index(child)  # the item's place in its loop tuple
        child, parent = parent, parents.get(parent)
    if isinstance(parent, ast.Assign) and child is parent.value:
        return any(isinstance(t, ast.Name) and t.id in names for t in parent.targets)
    if isinstance(parent, ast.AugAssign) and child is parent.value:
        return isinstance(parent.target, ast.Name) and parent.target.id in names
    if isinstance(parent, ast.For) and child is parent.iter and position is not None \
            and isinstance(parent.target, ast.Tuple) and position < len(parent.target.elts):
        target = parent.target.elts[position]
        return isinstance(target, ast.Name) and target.id in names
    return False


def _shown_nodes(tree: ast.AST) -> set[tuple[int, int, int, int]]:
    """The (start, end) positions of the str literals that reach a reader: inside the arguments
    of a call that prints or draws text, through joins, f-strings, ``.format`` and choices, or
    bound to a name that does (a variable, a loop variable) in the same cell."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = _shown_names(tree, parents)
    shown = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.JoinedStr)
                or isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if isinstance(parents.get(node), ast.JoinedStr):  # a constant part of an f-string
            continue
        if _reaches_a_reader(node, parents) or _bound_to_shown_name(node, parents, names):
            shown.add((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset))
    return shown


def code_units(source: str) -> list[Unit]:
    """The messages of one code cell, in order: its comments and shown literals that hold
    English words (tool markers aside)."""
    tokens = _tokens(source)
    try:
        shown = _shown_nodes(ast.parse(_python(source)))
    except SyntaxError:
        shown = set()
    units, i = [], 0
    by_start = {t.start: n for n, t in enumerate(tokens)}
    for (l0, c0, l1, c1) in sorted(shown):
        n = by_start.get((l0, c0))
        span = [k for k in range(n, len(tokens)) if tokens[k].start < (l1, c1)
                and tokens[k].type == tokenize.STRING] if n is not None else []
        prefixes = {_split_literal(tokens[k].string)[:2] for k in span}
        if len(prefixes) == 1:  # an implicit concatenation of one kind of literal: one message
            text = "".join(_split_literal(tokens[k].string)[2] for k in span)
            if holds_words(text):
                units.append(Unit("literal", tuple(span), text))
        else:
            units += [Unit("literal", (k,), _split_literal(tokens[k].string)[2]) for k in span
                      if holds_words(_split_literal(tokens[k].string)[2])]
    while i < len(tokens):
        t = tokens[i]
        if t.type != tokenize.COMMENT or _MARKER.match(t.string):
            i += 1
            continue
        block = [i]
        if not t.line[:t.start[1]].strip():  # a full-line comment: its block goes on below
            k = i + 1
            while k + 1 < len(tokens) and tokens[k].type == tokenize.NL and \
                    tokens[k + 1].type == tokenize.COMMENT and \
                    tokens[k + 1].start == (tokens[block[-1]].start[0] + 1, t.start[1]) and \
                    not _MARKER.match(tokens[k + 1].string):
                block.append(k + 1)
                k += 2
        text = " ".join(_comment_text(tokens[k].string) for k in block)
        if holds_words(text) and not _SHAPE.match(text):  # (B, T, h) reads the same in Chinese
            units.append(Unit("comment", tuple(block), text))
        i = block[-1] + 1
    return sorted(units, key=lambda u: u.tokens[0])


def _comment_text(token: str) -> str:
    return token[1:].strip()


def _split_literal(token: str) -> tuple[str, str, str]:
    """A string token's prefix (f, r, ...), its quote and its text."""
    m = re.match(r"(?is)([a-z]*)('''|\"\"\"|'|\")(.*)\2\Z", token)
    return m.group(1), m.group(2), m.group(3)


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


_BREAK_AFTER = set("，、；：。）」”")


def cut(text: str, sizes: list[int], literal: bool) -> list[str]:
    """``text`` cut into ``len(sizes)`` pieces in proportion to ``sizes`` (display widths): at a
    space or after a Chinese character, never inside a format field or an escape."""
    if len(sizes) == 1:
        return [text]
    safe, good, depth = [], set(), 0  # where a cut may fall; where it reads well
    for n, ch in enumerate(text):
        if n and depth == 0 and text[n - 1] != "\\" and (
                ch == " " or _width(text[n - 1]) == 2 or _width(ch) == 2):
            safe.append(n)
            if ch == " " or text[n - 1] in _BREAK_AFTER:
                good.add(n)
        depth += {"{": 1, "}": -1}.get(ch, 0)
    pieces, start, done = [], 0, 0
    for size in sizes[:-1]:
        done += size
        goal = len(text) * done / sum(sizes)
        n = min((p for p in safe if p > start),  # a word boundary near the goal goes first
                key=lambda p: abs(p - goal) - (len(text) / len(sizes) / 3 if p in good else 0),
                default=len(text))
        pieces.append(text[start:n] if literal else text[start:n].strip())
        start = n
    pieces.append(text[start:] if literal else text[start:].strip())
    return pieces


def translate_code(source: str, translations: dict[str, str]) -> tuple[str, list[str]]:
    """A code cell's ``source`` with each unit's tokens rewritten from its translation; also
    the messages that have none. Every other token keeps its text and place."""
    tokens = _tokens(source)
    texts = {n: t.string for n, t in enumerate(tokens)}
    missing = []
    for unit in code_units(source):
        chinese = translations.get(unit.message)
        if not chinese:
            missing.append(unit.message)
            continue
        if unit.kind == "comment":
            sizes = [_width(tokens[k].string) for k in unit.tokens]
            for k, piece in zip(unit.tokens, cut(chinese, sizes, literal=False)):
                texts[k] = "# " + piece if piece else "#"
        else:
            sizes = [_width(_split_literal(tokens[k].string)[2]) for k in unit.tokens]
            for k, piece in zip(unit.tokens, cut(chinese, sizes, literal=True)):
                prefix, quote, _ = _split_literal(tokens[k].string)
                texts[k] = prefix + quote + piece + quote
    for k in _setup_calls(tokens):  # what labkit prints is in Chinese from there on
        texts[k] = (SETUP_LANG if tokens[k - 1].string == "(" else ", " + SETUP_LANG) + ")"
    return _untokenize(source, tokens, texts), missing


# The one argument the Chinese lab adds: its labkit.setup(...) call (first cell) makes labkit print
# its tables, reasons and notes in Chinese (labkit.messages.use).
SETUP_LANG = 'lang="zh_CN"'


def _setup_calls(tokens) -> list[int]:
    """The index of the closing parenthesis of each ``labkit.setup(...)`` call in ``tokens``."""
    found = []
    for n in range(len(tokens) - 3):
        if [t.string for t in tokens[n:n + 4]] == ["labkit", ".", "setup", "("]:
            depth = 0
            for k in range(n + 3, len(tokens)):
                depth += {"(": 1, ")": -1}.get(tokens[k].string, 0) if tokens[k].type == tokenize.OP else 0
                if depth == 0:
                    found.append(k)
                    break
    return found


def english_setup(source: str) -> str:
    """A Chinese lab's code cell with its labkit.setup call as the English lab has it."""
    return source.replace(", " + SETUP_LANG + ")", ")").replace("(" + SETUP_LANG + ")", "()")


def _untokenize(source: str, tokens, texts: dict[int, str]) -> str:
    """``source`` with token n's text replaced by ``texts[n]`` (spans on one line each)."""
    lines = source.splitlines(keepends=True)
    for n in sorted(texts, reverse=True):  # from the end: earlier columns stay valid
        t = tokens[n]
        if texts[n] == t.string:
            continue
        (l0, c0), (l1, c1) = t.start, t.end
        if l0 != l1:
            raise ValueError(f"a multi-line token cannot be translated: {t.string[:60]!r}")
        line = lines[l0 - 1]
        lines[l0 - 1] = line[:c0] + texts[n] + line[c1:]
    return "".join(lines)


@functools.cache
def _kept() -> frozenset[str]:
    return frozenset(_i18n().kept_english())


def code_messages(lab: Path) -> list[tuple[str, str]]:
    """(message, "cell id") for every comment and shown literal of ``lab``'s code cells."""
    nb = json.loads(lab.read_text(encoding="utf-8"))
    return [(unit.message, cell.get("id", "")) for cell in nb["cells"]
            if cell["cell_type"] == "code" for unit in code_units("".join(cell["source"]))]


def write_code_templates(pot_dir: Path, labs: Path = LABS) -> None:
    """labs/NN_name.code.pot under ``pot_dir`` for every lab: its code messages."""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    for lab in sorted(Path(labs).glob("*.ipynb")):
        catalog = Catalog(project="Breaking the GPU Memory Wall", version="", charset="utf-8",
                          fuzzy=False)
        for message, where in code_messages(lab):
            catalog.add(message, auto_comments=[f"{lab.name}:{where}"]
                        if message not in catalog else [])
        pot = pot_dir / "labs" / f"{lab.stem}{_i18n().CODE_SUFFIX}.pot"
        pot.parent.mkdir(parents=True, exist_ok=True)
        with open(pot, "wb") as f:
            write_po(f, catalog, width=76, omit_header=False)


def code_translations(lab: Path) -> dict[str, str]:
    i18n = _i18n()
    return i18n.translations_of(i18n.LOCALE_DIR / "labs" / f"{lab.stem}{i18n.CODE_SUFFIX}.po")


def chinese_lab(lab: Path) -> tuple[dict, list[str]]:
    """The Chinese notebook of ``lab`` (a dict), not executed: Markdown and code translated,
    the English outputs still in place; and its untranslated messages."""
    i18n = _i18n()
    translations = i18n.translations_of(i18n.LOCALE_DIR / "labs" / f"{lab.stem}.po")
    code = code_translations(lab)
    nb = json.loads(lab.read_text(encoding="utf-8"))
    missing = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text, lost = translate_markdown("".join(cell["source"]), translations)
        elif cell["cell_type"] == "code":
            text, lost = translate_code("".join(cell["source"]), code)
        else:
            continue
        cell["source"] = text.splitlines(keepends=True)
        missing += lost
    nb.setdefault("metadata", {})["language"] = i18n.LANGUAGE
    return nb, missing


def _cjk_font() -> str:
    """The CJK font labkit.setup(lang="zh_CN") draws the Chinese lab's figures with
    (labkit.book.installed_cjk_font); none installed is an error here, not boxes in the figures."""
    from labkit.book import CJK_FONTS, installed_cjk_font

    font = installed_cjk_font()
    if font is None:
        raise SystemExit(f"error: none of the CJK fonts {CJK_FONTS[:-1]} is installed "
                         "(apt-get install fonts-noto-cjk)")
    return font


def execute(nb: dict, timeout: int = 900) -> dict:
    """``nb`` run top to bottom as the English labs are (nbconvert, from labs/); its
    labkit.setup(lang="zh_CN") call gives matplotlib the CJK font, so the drawn Chinese shows."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    _cjk_font()
    notebook = nbformat.reads(json.dumps(nb), as_version=4)
    ExecutePreprocessor(timeout=timeout).preprocess(notebook, {"metadata": {"path": str(LABS)}})
    return json.loads(nbformat.writes(notebook))


def text_of(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def resolve(name: str) -> Path:
    found = sorted(LABS.glob(f"{name.zfill(2)}_*.ipynb" if name.isdigit() else f"{name}.ipynb"))
    if len(found) != 1:
        raise SystemExit(f"error: lab {name!r} unknown; valid: "
                         f"{[p.stem for p in sorted(LABS.glob('*.ipynb'))]}")
    return found[0]


def main(argv=None) -> int:
    names = sys.argv[1:] if argv is None else argv
    labs = [resolve(n) for n in names] if names else sorted(LABS.glob("*.ipynb"))
    ZH_LABS.mkdir(exist_ok=True)
    for lab in labs:
        nb, missing = chinese_lab(lab)
        start = time.perf_counter()
        nb = execute(nb)
        (ZH_LABS / lab.name).write_text(text_of(nb), encoding="utf-8")
        print(f"wrote labs/zh/{lab.name}, run in {time.perf_counter() - start:.0f} s"
              + (f": {len(missing)} messages untranslated" if missing else ""))
        for message in missing:
            print("   ", message[:100])
    return 0


if __name__ == "__main__":
    sys.exit(main())
