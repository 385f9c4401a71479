"""What the book's calculators, the exercise grader and labkit's printed text say, in each
edition's language.

One table of strings per language (``CATALOGUES["en"]``, ``CATALOGUES["zh_CN"]``: ``en.py`` and
``zh_cn.py`` beside this file), keyed by a
*kind* such as ``"plan.overflow"``; :func:`render` fills a kind's template with structured
fields (numbers, names, terms), so no English sentence is parsed or pasted into a Chinese one:

    >>> render("plan.overflow", "zh_CN", term="activations", bytes_so_far=91.2e9, limit_bytes=77.3e9)
    '计入激活值后累计 91.2 GB，超过上限 77.3 GB'

A field is written ``{name}``, or ``{name:spec}`` where ``spec`` is Python's format spec or one of
this module's: ``.1GB`` (bytes as GB, 1 decimal), ``GB`` (bytes as GB, to the field ``digits``
decimals, 1 without it), ``term`` and ``phase`` (the field is a kind's suffix, e.g.
``term.activations``, ``phase.backward``, rendered in the same language), ``list`` (items joined by the language's
list separator; a shape feature by its ``feature.`` text), ``opt.precision`` and
``opts.precision`` (an option's text, or a list of them), ``q`` (quoted the language's way),
``arg`` (an argument's name, after its form label), ``val`` and ``vals`` (the value or values of
the argument the field ``name`` names, as its options read). The Chinese strings use the glossary's terms
(locales/zh_CN/GLOSSARY.md; tests/test_i18n.py checks them). Standard library only: the
calculators run it in the page (Brython).

labkit's own printed text (the planner's tables and reasons, the estimates' breakdowns, the
meter's table, the engines' notes, the exceptions a lab prints) is worded here too, in the
language :func:`use` sets for the process (``labkit.setup(lang="zh_CN")``; English by default):
:func:`say` renders a kind in it. The command line stays English (it runs under ``using("en")``).

:func:`error_message` renders an exception labkit raised: an :class:`labkit.validate.ArgumentError`
carries ``kind`` and ``fields`` (``ArgumentError(..., kind="context_len", context_len=8192,
seq_len=4096)``); any other error is rendered as ``"error.other"`` around its own text.
"""

from __future__ import annotations

import re

from .en import CATALOGUE as _EN
from .zh_cn import CATALOGUE as _ZH

__all__ = ["CATALOGUES", "LANGUAGES", "language", "known", "render", "pieces", "error_message",
           "training_reason", "serving_reason", "use", "current", "using", "say", "width", "pad"]

LANGUAGES = ("en", "zh_CN")

CATALOGUES = {"en": _EN, "zh_CN": _ZH}

_FIELD = re.compile(r"\{(\w*)(![rs])?(?::([^{}]*))?\}")


def language(lang) -> str:
    """The catalogue for ``lang``: "en", "zh_CN"; "zh", "zh-CN", "zh-Hans" and "en-US" are read
    as their catalogue; anything else is a ValueError naming ``lang``."""
    if not isinstance(lang, str):
        raise ValueError(f"lang={lang!r} must be a language code, one of {list(LANGUAGES)}")
    code = lang.replace("-", "_")
    if code in CATALOGUES:
        return code
    base = code.split("_")[0].lower()
    for name in LANGUAGES:
        if name.split("_")[0] == base:
            return name
    raise ValueError(f"lang={lang!r} has no catalogue; valid: {list(LANGUAGES)} (or zh, zh-CN)")


# The language labkit's own printed text takes when a caller names none: tables, reasons, notes,
# the banner of labkit.setup (which sets it: ``labkit.setup(lang="zh_CN")``, as the Chinese labs
# do). English unless set; the command line always speaks English (labkit.plan.cli).
_CURRENT = ["en"]


def use(lang) -> str:
    """Make ``lang`` the language of labkit's printed text in this process; returns the one it
    replaces."""
    previous, _CURRENT[0] = _CURRENT[0], language(lang)
    return previous


def current() -> str:
    """The language labkit's printed text is in now ("en" unless :func:`use` said otherwise)."""
    return _CURRENT[0]


class using:
    """``with using("en"): ...``: ``lang`` for the block, the previous language after it."""

    def __init__(self, lang):
        self.lang = language(lang)

    def __enter__(self):
        self.previous = use(self.lang)
        return self.lang

    def __exit__(self, *exc):
        use(self.previous)
        return False


def say(kind: str, **fields) -> str:
    """``kind`` rendered in the current language (:func:`current`)."""
    return render(kind, current(), **fields)


# East Asian wide and fullwidth characters take two columns of a terminal or a notebook's output
# (no unicodedata: Brython runs this module in the page).
_WIDE = ((0x1100, 0x115F), (0x2E80, 0x303E), (0x3041, 0x33FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF),
         (0xA000, 0xA4CF), (0xAC00, 0xD7A3), (0xF900, 0xFAFF), (0xFE30, 0xFE4F), (0xFF00, 0xFF60),
         (0xFFE0, 0xFFE6))


def width(text) -> int:
    """The columns ``text`` takes in a monospaced font: two for each wide (CJK) character."""
    return sum(2 if any(a <= ord(c) <= b for a, b in _WIDE) else 1 for c in str(text))


def pad(text, columns: int, align: str = "<") -> str:
    """``text`` padded with spaces to ``columns`` display columns: ``align`` "<" (left) or ">"."""
    text = str(text)
    fill = " " * max(0, columns - width(text))
    return text + fill if align == "<" else fill + text


def known(kind: str) -> bool:
    """Whether the catalogues have ``kind``."""
    return kind in _EN


def _template(kind, lang) -> str:
    if not isinstance(kind, str) or kind not in _EN:
        raise ValueError(f"kind={kind!r} is not in the catalogue (labkit.messages)")
    return CATALOGUES[language(lang)].get(kind, _EN[kind])


def _option_text(name, value, lang) -> str:
    """A value as the reader chose it: its option's text where the catalogue has one, else the
    value quoted (a number as it is)."""
    kind = f"option.{name}.{value}"
    if kind in _EN:
        return render(kind, lang)
    return str(value) if isinstance(value, (int, float)) else _template("quote", lang).format(value)


def _format(value, conversion, spec, lang, fields) -> str:
    spec = spec or ""
    if spec == "arg":  # an argument's name: its field's label where the form has one, then the name
        label = "label." + str(value)
        return f"{render(label, lang)}（{value}）" if label in _EN and render(label, lang) != value else str(value)
    if spec in ("val", "vals"):  # the value(s) of the argument named by the field "name"
        texts = [_option_text(fields.get("name"), v, lang) for v in (value if spec == "vals" else [value])]
        return _template("list.separator", lang).join(texts)
    if spec in ("term", "phase"):  # a memory term, a step's phase: its kind's text
        return render(f"{spec}.{value}", lang) if f"{spec}.{value}" in _EN else str(value)
    if spec == "GB":  # bytes as GB, to the field "digits" decimals (1 without it)
        return format(value / 1e9, f".{fields.get('digits', 1)}f") + " GB"
    if spec == "list":
        return _template("list.separator", lang).join(
            render("feature." + v, lang) if isinstance(v, str) and "feature." + v in _EN else str(v)
            for v in value)
    if spec.startswith("opt.") or spec.startswith("opts."):  # an option's text, or a list of them
        prefix = "option." + spec.split(".", 1)[1] + "."
        texts = [render(prefix + v, lang) if prefix + v in _EN else str(v)
                 for v in (value if spec.startswith("opts.") else [value])]
        return _template("list.separator", lang).join(texts)
    if spec == "q":
        return _template("quote", lang).format(value)
    if conversion == "!r":
        value = repr(value)
    elif conversion == "!s":
        value = str(value)
    if spec and spec.endswith("GB"):
        return format(value / 1e9, spec[:-2] + "f") + " GB"
    return format(value, spec or "")


def pieces(kind: str, lang: str = "en", **fields) -> list:
    """``kind`` in ``lang`` as a list of (text, field name or None): the calculators wrap each
    field's text in an element that carries its exact value."""
    template, out, at = _template(kind, lang), [], 0
    for m in _FIELD.finditer(template):
        name, conversion, spec = m.group(1), m.group(2), m.group(3)
        if name not in fields:
            raise ValueError(f"{kind}: field {name!r} missing; given {sorted(fields)}")
        if m.start() > at:
            out.append((template[at:m.start()], None))
        out.append((_format(fields[name], conversion, spec, lang, fields), name))
        at = m.end()
    if at < len(template):
        out.append((template[at:], None))
    return out


def render(kind: str, lang: str = "en", **fields) -> str:
    """``kind``'s template in ``lang`` (a ValueError names an unknown kind or language, or a field
    the template needs and ``fields`` lacks)."""
    return "".join(text for text, _ in pieces(kind, lang, **fields))


def error_message(error: BaseException, lang: str = "en") -> str:
    """What to show for ``error``: its structured kind rendered in ``lang`` when it has one
    (``labkit.validate.ArgumentError``), else ``"error.other"`` around its text."""
    kind = getattr(error, "kind", None)
    if kind and "error." + kind in _EN:
        try:
            return render("error." + kind, lang, **getattr(error, "fields", {}))
        except (ValueError, KeyError, TypeError):
            pass  # fields that do not match the template: say it as raised
    return render("error.other", lang, detail=str(error))


def training_reason(overflows, lang: str = "en", refused=None) -> str:
    """Why no training plan fits, from ``TrainingPlans.overflows`` (``labkit.plan.Overflow``:
    each layout's leanest configuration and the term that passed the limit), the closest first,
    and ``TrainingPlans.refused`` (what labkit does not run, by reason) when nothing was sized;
    in English, the text of ``TrainingPlans.reason()``."""
    if not overflows and refused:  # {labkit.parallel.compose's key: configurations}
        what = [render(f"refused.{key}", lang) for key in sorted(refused, key=lambda k: (-refused[k], k))]
        return render("plan.refused", lang, what=render("plan.refused_separator", lang).join(what))
    if not overflows:
        return render("plan.no_layout", lang)
    lines = []
    for o in sorted(overflows, key=lambda o: o.leanest.memory.total):
        cp = render("plan.layout_cp", lang, cp_size=o.cp_size) if o.cp_size > 1 else ""
        why = render("plan.overflow", lang, term=o.term, bytes_so_far=o.bytes_so_far,
                     limit_bytes=o.limit_bytes)
        lines.append(render("plan.layout", lang, tp_size=o.tp_size, cp=cp, pp_size=o.pp_size,
                            dp_size=o.dp_size, why=why))
    return render("plan.separator", lang).join(lines)


def serving_reason(refused, lang: str = "en") -> str:
    """Why each refused tensor-parallel degree serves nothing, from ``ServingPlans.refused``; in
    English, the text of ``ServingPlans.reason()``."""
    def ep(p) -> str:  # expert parallelism said after t
        return render("serve.ep", lang) if getattr(p, "expert_parallel", False) else ""

    return render("plan.separator", lang).join(
        render("serve.no_block", lang, tp_size=p.tp_size, ep=ep(p)) if p.bound == "weights"
        else render("serve.too_few_blocks", lang, tp_size=p.tp_size, ep=ep(p), num_blocks=p.num_blocks)
        for p in refused)
