"""Write the Chinese lab notebooks, labs/zh/NN_name.ipynb, from the English ones and the catalogues.

    python scripts/zh_labs.py [LAB ...]     # default: every lab; LAB is a name or its number

Each is the English lab, its code and outputs (so its numbers) unchanged, with every heading,
paragraph, list item and table cell of its Markdown cells replaced by its translation in
locales/zh_CN/LC_MESSAGES/labs/NN_name.po: the catalogue the Chinese edition's lab page comes
from (Sphinx's gettext messages, one per paragraph, its line breaks joined). A message with no
translation stays English and is listed. Relative links gain a ../ (the notebook is one folder
down) and the exercises' Colab links open the Chinese exercise notebooks (exercises/student/zh/).
The code, its comments and what it prints stay English. Re-run it after a lab is re-run or its
catalogue changes: tests/test_i18n.py checks that each Chinese lab is what this writes. The
Chinese edition's lab pages link to these notebooks (Colab, download: _ext/chinese_labs.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
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


def chinese_lab(lab: Path) -> tuple[dict, list[str]]:
    """The Chinese notebook of ``lab`` (a dict), and its untranslated messages."""
    i18n = _i18n()
    translations = i18n.translations_of(i18n.LOCALE_DIR / "labs" / f"{lab.stem}.po")
    nb = json.loads(lab.read_text(encoding="utf-8"))
    missing = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text, lost = translate_markdown("".join(cell["source"]), translations)
            cell["source"] = text.splitlines(keepends=True)
            missing += lost
    nb.setdefault("metadata", {})["language"] = i18n.LANGUAGE
    return nb, missing


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
        (ZH_LABS / lab.name).write_text(text_of(nb), encoding="utf-8")
        print(f"wrote labs/zh/{lab.name}" + (f": {len(missing)} messages untranslated"
                                              if missing else ""))
        for message in missing:
            print("   ", message[:100])
    return 0


if __name__ == "__main__":
    sys.exit(main())
