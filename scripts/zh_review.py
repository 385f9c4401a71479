"""The Chinese edition's review (../shared/reviews/zh.md, commit 0766ae6): its counts then and now.

    python scripts/zh_review.py            # the before/after tables (Markdown) on stdout
    python scripts/zh_review.py --check    # exit 1 unless the verdicts cover the sample and no
                                           # forbidden variant is left
    python scripts/zh_review.py --pending  # the sampled messages that need a verdict, in full
    python scripts/zh_review.py --write    # the tables into scripts/results/zh_review.md

The sample is the review's Appendix A: in each catalogue of 0766ae6 (read with ``git show``), the
messages with a non-empty msgid in file order, indices floor(j * n / m). Each sampled message is
followed to the current catalogue: the same msgid, else (its English changed or left) the new
message that shares most of its words, stated as such, or none (GONE). Before: the review's
verdict (Appendix B; the rest OK). After: the verdicts in scripts/results/zh_review_verdicts.json,
each pinned to the translation it judged (sha1); a sampled message with no verdict counts OK only
if its translation is byte-identical to the one the review judged OK. The term table counts, over every msgstr of every
catalogue then and now, the variants of the review's section 3 and the countable markup of section
5; the variants the glossary forbids (locales/zh_CN/GLOSSARY.md) must count 0 now.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCALE = "locales/zh_CN/LC_MESSAGES"
REVIEWED = "0766ae6"
VERDICTS = ROOT / "scripts" / "results" / "zh_review_verdicts.json"
REPORT = ROOT / "scripts" / "results" / "zh_review.md"
MARKER = "<!-- Everything above is written by `python scripts/zh_review.py --write`. -->"
KINDS = ("OK", "AWKWARD", "WRONG", "TERM")

# Appendix A: the sample size m of each catalogue (references.po is not sampled).
SIZES = {"chapters/01_memory_wall": 26, "chapters/02_zero": 26, "chapters/04_accumulation": 26,
         "chapters/07_flash_attention": 26, "chapters/09_planning": 26,
         "chapters/10_context_parallel": 26, "chapters/03_checkpointing": 8,
         "chapters/05_tensor_parallel": 8, "chapters/06_pipeline": 8,
         "chapters/08_paged_attention": 8, "intro": 8, "exercises/notebooks": 20,
         "exercises/index": 5, "GPU_RESULTS": 2,
         **{f"labs/{n}": 6 for n in ("01_memory_wall", "02_zero", "03_checkpointing",
                                     "04_accumulation", "05_tensor_parallel", "06_pipeline",
                                     "07_flash_attention", "08_paged_attention", "09_planning",
                                     "10_context_parallel")}}
# Section 1's table as the review printed it: (sampled, total, OK, AWKWARD, WRONG, TERM); the
# ten labs are one row. The script's own counts must reproduce it.
REVIEW_TABLE = {"chapters/01_memory_wall": (26, 70, 23, 1, 1, 1),
                "chapters/02_zero": (26, 75, 23, 1, 1, 1),
                "chapters/03_checkpointing": (8, 82, 8, 0, 0, 0),
                "chapters/04_accumulation": (26, 48, 23, 2, 1, 0),
                "chapters/05_tensor_parallel": (8, 45, 6, 2, 0, 0),
                "chapters/06_pipeline": (8, 35, 8, 0, 0, 0),
                "chapters/07_flash_attention": (26, 61, 21, 4, 0, 1),
                "chapters/08_paged_attention": (8, 44, 4, 1, 0, 3),
                "chapters/09_planning": (26, 50, 20, 5, 0, 1),
                "chapters/10_context_parallel": (26, 31, 20, 5, 0, 1),
                "labs/*": (60, 382, 48, 5, 0, 7),
                "exercises/notebooks": (20, 155, 14, 1, 1, 4),
                "exercises/index": (5, 61, 5, 0, 0, 0),
                "intro": (8, 108, 7, 0, 0, 1),
                "GPU_RESULTS": (2, 12, 2, 0, 0, 0)}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


i18n = _load("i18n_script", ROOT / "scripts" / "i18n.py")


def _read(data: bytes) -> list:
    from babel.messages.pofile import read_po

    return [m for m in read_po(io.BytesIO(data), charset="utf-8") if m.id]


def _with_lines(data: bytes) -> list:
    """A catalogue's messages, each given ``line``: the first line of its entry, comments and
    flags included (the review's L, as polib numbers entries)."""
    msgs = _read(data)
    text = data.decode("utf-8").splitlines()
    lines = []
    for n, line in enumerate(text):
        if line.startswith("msgid "):
            while n and text[n - 1].startswith("#"):  # its comments and flags come first
                n -= 1
            lines.append(n + 1)
    lines = lines[1:]  # the header's msgid ""
    if len(lines) != len(msgs):
        raise ValueError(f"{len(lines)} msgid lines for {len(msgs)} messages")
    for m, n in zip(msgs, lines):
        m.line = n
    return msgs


def old_catalogues() -> dict[str, list]:
    """{catalogue: its messages} at the reviewed commit, read with ``git show``."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", REVIEWED, LOCALE + "/"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {n[len(LOCALE) + 1:-3]: _with_lines(subprocess.run(
        ["git", "show", f"{REVIEWED}:{n}"], cwd=ROOT, capture_output=True, check=True).stdout)
        for n in names if n.endswith(".po")}


def new_catalogues() -> dict[str, list]:
    """{catalogue: its messages} in the working tree."""
    base = ROOT / LOCALE
    return {p.relative_to(base).with_suffix("").as_posix(): _read(p.read_bytes())
            for p in sorted(base.rglob("*.po"))}


def sha(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def row_of(catalogue: str) -> str:
    return "labs/*" if catalogue.startswith("labs/") else catalogue


def sample(old: dict[str, list], new: dict[str, list]) -> list[dict]:
    """The review's 283 messages, each with its current counterpart."""
    found = []
    for name in sorted(SIZES):
        msgs, m = old[name], SIZES[name]
        current = new.get(name, [])
        for i in sorted({j * len(msgs) // m for j in range(m)}):
            then = msgs[i]
            item = {"catalogue": name, "index": i, "line": then.line, "en": then.id,
                    "zh_then": then.string, "how": "same msgid", "en_now": then.id}
            now = next((x for x in current if x.id == then.id), None)
            if now is None:  # the English changed or left: look where it stood
                now, item["how"] = successor(msgs, i, current)
                item["en_now"] = now.id if now is not None else None
            item["zh_now"] = now.string if now is not None else None
            found.append(item)
    return found


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def successor(msgs: list, i: int, current: list):
    """The current message that took the place of ``msgs[i]``, whose English changed or left:
    of the current messages whose English is new (not a msgid of the reviewed catalogue), the
    one sharing the most words with it (Jaccard); None when none shares a fifth."""
    olds = {x.id for x in msgs}
    words = _words(msgs[i].id)
    scored = [(len(words & _words(x.id)) / len(words | _words(x.id)), k)
              for k, x in enumerate(current) if x.id not in olds]
    score, k = max(scored, default=(0.0, -1))
    if score < 0.2:
        return None, "gone: no current message shares a fifth of its words"
    return current[k], f"English changed: the new message sharing most words ({score:.2f})"


def load_verdicts(path: Path = VERDICTS) -> tuple[dict, dict]:
    """({(catalogue, index): the review's (verdict, why)}, {(catalogue, index): the entry})."""
    data = json.loads(path.read_text(encoding="utf-8"))
    before = {(e["catalogue"], e["index"]): (e["verdict"], e["why"], e["line"])
              for e in data["review"]}
    after = {(e["catalogue"], e["index"]): e for e in data["verdicts"]}
    return before, after


def judge(items: list[dict], before: dict, after: dict) -> list[str]:
    """Give each item its before and after verdict; return what the verdict file lacks."""
    problems = []
    for it in items:
        key = (it["catalogue"], it["index"])
        it["before"], it["before_why"], line = before.get(key, ("OK", "", it["line"]))
        if line != it["line"]:
            problems.append(f"{key}: the review's line {line} is not the sample's {it['line']}")
        entry = after.get(key)
        if it["zh_now"] is None and entry is None:  # nothing left to judge: a fact, not a verdict
            it["after"], it["after_why"] = "GONE", it["how"]
            continue
        unchanged = it["zh_now"] == it["zh_then"] and it["en_now"] == it["en"]
        if entry is None:
            if unchanged and it["before"] == "OK":
                it["after"], it["after_why"] = "OK", "unchanged since the review, judged OK there"
                continue
            problems.append(f"{key}: no verdict; its translation changed or the review judged "
                            f"it {it['before']}: {it['zh_now']!r}")
            it["after"], it["after_why"] = "?", ""
            continue
        if entry["verdict"] not in KINDS:
            problems.append(f"{key}: verdict {entry['verdict']!r} is none of {KINDS}")
        if entry["sha1"] != sha(it["zh_now"] or ""):
            problems.append(f"{key}: the verdict judged another translation (sha1 "
                            f"{entry['sha1']}, now {sha(it['zh_now'] or '')}): {it['zh_now']!r}")
        it["after"], it["after_why"] = entry["verdict"], entry["why"]
    keys = {(it["catalogue"], it["index"]) for it in items}
    problems += [f"{k}: a verdict for a message outside the sample" for k in after
                 if k not in keys]
    problems += [f"{k}: a review verdict for a message outside the sample" for k in before
                 if k not in keys]
    return problems


def verdict_table(items: list[dict], which: str) -> dict[str, Counter]:
    table: dict[str, Counter] = {}
    for it in items:
        table.setdefault(row_of(it["catalogue"]), Counter())[it[which]] += 1
    return table


def review_table_problems(items: list[dict], old: dict[str, list]) -> list[str]:
    """Where the sample or the transcribed verdicts do not give the review's section 1."""
    table = verdict_table(items, "before")
    problems = []
    for row, (m, n, *counts) in REVIEW_TABLE.items():
        names = [c for c in SIZES if row_of(c) == row]
        got = (sum(table[row].values()), sum(len(old[c]) for c in names),
               *(table[row][k] for k in KINDS))
        if got != (m, n, *counts):
            problems.append(f"{row}: the sample gives {got}, the review's table {(m, n, *counts)}")
    return problems


# ----------------------------------------------------------------------------- term counts
def _glossary(pattern: str) -> str:
    """A forbidden variant's pattern, as the glossary states it (so the counts use its rule)."""
    if pattern not in i18n.forbidden_variants():
        raise KeyError(f"the glossary no longer forbids {pattern!r}: update TERMS")
    return pattern


EXERCISES = ("exercises/",)
# (concept, variant, regular expression, catalogues (prefixes; () = all), where: "prose" (roles,
# code, math and URLs left out, as the glossary check does) or "raw", target now: "0, glossary"
# for a forbidden variant, "0" for one the review asked to remove, "" for a count).
G, Z = "0, glossary", "0"
TERMS = [
    ("memory wall", "内存墙", r"内存墙", (), "prose", ""),
    ("memory wall", "显存墙", _glossary("显存墙"), (), "prose", G),
    ("GPU memory", "内存 in the exercises (any use; host memory is 内存)", r"内存(?!墙)",
     EXERCISES, "prose", ""),
    ("GPU memory", "内存 for GPU memory (the glossary's pattern)", _glossary(
        r"(?:GPU\s*的?|训练|rank\s*的?|峰值)内存(?!墙)|内存(?:预算|消耗)"), (), "prose", G),
    ("chapter 1 title", "显存都去哪儿了", r"显存都去哪儿了", (), "raw", ""),
    ("chapter 1 title", "显存去了哪里", r"显存去了哪里", (), "raw", Z),
    ("chapter 1 title", "内存都去哪儿了", r"内存都去哪儿了", (), "raw", Z),
    ("memory meter", "显存计量器", r"显存计量器", (), "prose", ""),
    ("memory meter", "内存计量器", _glossary("内存计量器"), (), "prose", G),
    ("temporaries", "临时缓冲区", r"临时缓冲区", (), "prose", ""),
    ("temporaries", "临时峰值", r"临时峰值", (), "prose", ""),
    ("temporaries", "临时量", _glossary("临时量"), (), "prose", G),
    ("Adam's moments", "一阶矩", r"一阶矩", (), "prose", ""),
    ("Adam's moments", "矩估计", r"矩估计", (), "prose", ""),
    ("Adam's moments", "动量 (any use; SGD momentum is 动量)", r"动量", (), "prose", ""),
    ("Adam's moments", "两个动量", _glossary("两个动量"), (), "prose", G),
    ("prompt", "提示词", r"提示词", (), "prose", ""),
    ("prompt", "提示 without 词 (any use; a hint is 提示)", r"提示(?!词)", (), "prose", ""),
    ("prompt", "prompt", r"(?i)\bprompts?\b", (), "prose", ""),
    ("notebook", "notebook", r"(?i)\bnotebooks?\b", (), "prose", ""),
    ("notebook", "笔记本 (not 笔记本电脑)", _glossary("笔记本(?!电脑)"), (), "prose", G),
    ("notebook", "笔记本电脑 (laptop)", r"笔记本电脑", (), "prose", ""),
    ("reduce", "归约", r"归约", (), "prose", ""),
    ("reduce", "规约", _glossary("规约"), (), "prose", G),
    ("bucket", "桶", r"桶", (), "prose", ""),
    ("bucket", "bucket", _glossary("(?i)bucket"), (), "prose", G),
    ("token", "token", r"(?i)\btokens?\b", (), "prose", ""),
    ("token", "词元", _glossary("词元"), (), "prose", G),
    ("GPU measure word", "张 GPU", r"张(?=\s*(?:N\s*GB\s*|\d+\s*GB\s*)?(?:GPU|[AHV]100|H200))",
     (), "prose", ""),
    ("GPU measure word", "个/块/台 GPU", _glossary(
        r"[个块台](?=\s*(?:N\s*GB\s*|\d+\s*GB\s*)?(?:GPU|[AHV]100|H200)"
        r"(?!\s*(?:SM|节点|集群|服务器)))"), (), "prose", G),
    ("step time", "单步耗时", r"单步耗时", (), "prose", ""),
    ("step time", "每步时间", r"每步时间", (), "prose", ""),
    ("step time", "步时", _glossary("(?<![同微每一])步时"), (), "prose", G),
    ("a run", "运行 for a training run", _glossary("发表的运行|规划一次(?:大规模)?运行"),
     (), "prose", G),
    ("activation checkpoints", "激活检查点", r"激活检查点", (), "prose", ""),
    ("activation checkpoints", "激活值检查点", _glossary("激活值检查点"), (), "prose", G),
    ("recomputation", "重计算", r"重计算", (), "prose", ""),
    ("recomputation", "重算 (kept for the verb)", r"重算", (), "prose", ""),
    ("HBM", "高带宽内存", r"高带宽内存", (), "prose", ""),
    ("HBM", "高带宽存储", _glossary("高带宽存储"), (), "prose", G),
    ("oracle", "理想情况", r"理想情况", (), "prose", ""),
    ("oracle", "先知", _glossary("(?<!预)先知"), (), "prose", G),
    ("multiples", "增长了 N 倍 / 快 N 倍 ... for ×N", _glossary(
        r"(?:增长|增加|提高|提升|下降|降低|减少|缩小|扩大|高出|快|慢|少|多|大|小|长)了?\s*"
        r"(?:至多|最多|约|近)?\s*(?:[\d.,]+|N|[一二两三四五六七八九十百千万几数好]+)\s*倍"),
     (), "prose", G),
    ("quotation marks", "“…” (Chinese)", r"“", (), "prose", ""),
    ("quotation marks", "ASCII \" in prose", _glossary('"'), (), "prose", G),
    ("et al.", "等人", r"等人", (), "prose", ""),
    ("et al.", "et al.", _glossary(r"(?i)\bet al\b"), (), "prose", G),
    ("equation references (§5)", "{eq} roles (rendered 式 (N) in zh now)", r"\{eq\}`", (),
     "raw", ""),
    ("equation references (§5)", "\"Eq.\" written in a translation", r"\bEq\.", (), "raw", Z),
    ("glued text (§5)", "{glue:text} of a string (:s)", r"\{glue:text\}`[^`]*:s`", (), "raw", ""),
]


def _text_of(msgstr: str, where: str) -> str:
    return i18n.prose_of(msgstr) if where == "prose" else msgstr


def count_terms(catalogues: dict[str, list]) -> list[int]:
    """Occurrences of each TERMS row over every msgstr of ``catalogues``."""
    counts = []
    for _, _, pattern, scope, where, _ in TERMS:
        counts.append(sum(len(re.findall(pattern, _text_of(m.string, where)))
                          for name, msgs in catalogues.items()
                          if not scope or name.startswith(scope)
                          for m in msgs if m.string))
    return counts


def markup_counts(catalogues: dict[str, list]) -> dict[str, int]:
    """Section 5's markup the glossary's rules judge: display equations whose \\text{} breaks the
    rule, translations Sphinx drops (they start like a list item)."""
    kept = i18n.kept_english()
    english_text = renamed = dropped = 0
    for name, msgs in catalogues.items():
        for m in msgs:
            if not m.string:
                continue
            if name != i18n.NOTEBOOKS_DOMAIN and i18n._BLOCK_START.match(m.string):
                dropped += 1
            if not i18n.is_display_math(m.id):
                continue
            if Counter(i18n._SYMBOL_TEXT.findall(m.id)) != \
                    Counter(i18n._SYMBOL_TEXT.findall(m.string)):
                renamed += 1
            if any(w.lower() not in kept for x in i18n._PROSE_TEXT.findall(m.string)
                   for w in i18n._LATIN_WORD.findall(x)):
                english_text += 1
    return {"display equations with an English prose \\text{}": english_text,
            "display equations whose symbol subscript \\text{} differs from the English": renamed,
            "translations Sphinx drops (start like a list item: \"1. \")": dropped}


# ----------------------------------------------------------------------------- report
def _counts(c: Counter) -> str:
    return " / ".join(str(c[k]) for k in KINDS) + (f" ({c['GONE']} gone)" if c["GONE"] else "")


def report(items: list[dict], terms: tuple[list[int], list[int]],
           markup: tuple[dict, dict]) -> str:
    before, after = verdict_table(items, "before"), verdict_table(items, "after")
    out = ["# The Chinese edition's review: before and after", "",
           f"Generated by `python scripts/zh_review.py --write` from the catalogues at {REVIEWED} "
           "(the review's, read with `git show`) and in the working tree, with the verdicts of "
           "`scripts/results/zh_review_verdicts.json`.", "",
           "## 1. The sample's verdicts (OK / AWKWARD / WRONG / TERM)", "",
           "| catalogue | sampled | before | after | translation changed | English changed |",
           "|---|---:|---|---|---:|---:|"]
    total_b, total_a = Counter(), Counter()
    for row in REVIEW_TABLE:
        rows = [it for it in items if row_of(it["catalogue"]) == row]
        changed = sum(it["zh_now"] != it["zh_then"] for it in rows)
        moved = sum(it["en_now"] != it["en"] for it in rows)
        out.append(f"| `{row}` | {len(rows)} | {_counts(before[row])} | {_counts(after[row])} "
                   f"| {changed} | {moved} |")
        total_b.update(before[row])
        total_a.update(after[row])
    n = len(items)
    out.append(f"| **total** | {n} | {_counts(total_b)} | {_counts(total_a)} | "
               f"{sum(it['zh_now'] != it['zh_then'] for it in items)} | "
               f"{sum(it['en_now'] != it['en'] for it in items)} |")
    out += ["", "Shares: before " + ", ".join(f"{k} {100 * total_b[k] / n:.1f}%" for k in KINDS)
            + "; after " + ", ".join(f"{k} {100 * total_a[k] / n:.1f}%" for k in KINDS) + ".",
            "", "Every sampled message the review judged other than OK, or whose translation or "
            "English changed since (`#` is Appendix A's index, `L` the review's line):", "",
            "| catalogue | # | L | before | after | matched by | why (after) |",
            "|---|---:|---:|---|---|---|---|"]
    for it in items:
        if it["before"] != "OK" or it["zh_now"] != it["zh_then"] or it["en_now"] != it["en"]:
            why = it["after_why"].replace("|", "\\|")
            out.append(f"| `{it['catalogue']}` | {it['index']} | {it['line']} | {it['before']} "
                       f"| {it['after']} | {it['how']} | {why} |")
    out += ["", "## 2. Terms and markup over every msgstr of every catalogue", "",
            "Occurrences (prose: roles, code, math and URLs left out, as the glossary check does; "
            "the `{eq}`, `Eq.` and glue rows count the raw text). Target \"0, glossary\": a "
            "variant `locales/zh_CN/GLOSSARY.md` forbids (`scripts/i18n.py check` rejects it); "
            "\"0\": one the review asked to remove.", "",
            "| concept | variant | target | before | now |", "|---|---|---|---:|---:|"]
    for (concept, variant, _, scope, _, target), b, a in zip(TERMS, *terms):
        where = f" (in {', '.join(scope)})" if scope else ""
        out.append(f"| {concept} | {variant.replace('|', '/')}{where} | {target} | {b} | {a} |")
    for key in markup[0]:
        out.append(f"| markup (§5) | {key} | 0, glossary | {markup[0][key]} | {markup[1][key]} |")
    return "\n".join(out) + "\n"


def term_problems(now: list[int], markup_now: dict) -> list[str]:
    problems = [f"{concept}: {variant} counts {a}, the target is 0"
                for (concept, variant, _, _, _, target), a in zip(TERMS, now) if target and a]
    return problems + [f"markup: {k}: {v}, the target is 0" for k, v in markup_now.items() if v]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--pending", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    old, new = old_catalogues(), new_catalogues()
    items = sample(old, new)
    problems = judge(items, *load_verdicts())
    if args.pending:
        for it in items:
            if it["after"] == "?" or it["after_why"] and it["after_why"] != \
                    "unchanged since the review, judged OK there":
                print(json.dumps({k: it[k] for k in ("catalogue", "index", "before", "before_why",
                                                     "how", "en", "en_now", "zh_then", "zh_now",
                                                     "after", "after_why")},
                                 ensure_ascii=False, indent=1))
        return 0
    problems += review_table_problems(items, old)
    terms = count_terms(old), count_terms(new)
    markup = markup_counts(old), markup_counts(new)
    problems += term_problems(terms[1], markup[1])
    text = report(items, terms, markup)
    if args.write:
        kept = REPORT.read_text(encoding="utf-8").split(MARKER, 1)[1] \
            if REPORT.is_file() and MARKER in REPORT.read_text(encoding="utf-8") else "\n"
        REPORT.write_text(text + "\n" + MARKER + kept, encoding="utf-8")
    elif not args.check:
        print(text)
    if problems:
        print(f"{len(problems)} problems:\n" + "\n".join("  " + p for p in problems),
              file=sys.stderr)
    return 1 if problems and (args.check or args.write) else 0


if __name__ == "__main__":
    sys.exit(main())
