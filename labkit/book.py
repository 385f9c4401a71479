"""What a lab needs from the book that it is part of: ``glue``, which hands a value to a chapter.

When the book is built, :func:`myst_nb.glue` stores the value in the notebook's outputs for the
chapter's ``{glue}`` roles; anywhere else (Colab, a plain Jupyter) the call does nothing.

A value that is words or a figure comes in each edition's language: ``glue(name, english,
zh=chinese)`` also glues ``name + ZH_SUFFIX``, and the Chinese edition reads that key wherever a
page asks for ``name`` (_ext/i18n_glue.py). :func:`glue_figure` draws a figure once per language,
the Chinese one with a CJK font; :data:`CHINESE` words the labels the labs glue (phases, memory
terms, recomputation policies) and :func:`overflow_text` a planner's overflow, in either language.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from .messages import render
from .validate import check_bool, check_int

__all__ = ["glue", "glue_figure", "chinese_figures", "chinese_text", "overflow_text", "CHINESE",
           "ZH_SUFFIX", "CJK_FONTS", "installed_cjk_font", "draw_chinese"]

ZH_SUFFIX = "_zh"
# The Chinese figures' fonts, the first one installed wins (fonts-noto-cjk, which the browser test
# already needs); DejaVu Sans draws what they lack.
CJK_FONTS = ["Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Serif CJK SC", "DejaVu Sans"]

# The words labs glue, in Chinese, by kind: a step's phases (labkit.memory's meter), the memory
# terms (labkit.plan.TERMS), the recomputation policies. labkit.messages' catalogue words them,
# as it does for the calculators and the planner's reasons (locales/zh_CN/GLOSSARY.md's terms).
CHINESE = {
    "phase": {p: render(f"phase.{p}", "zh_CN") for p in ("forward", "backward", "optimizer")},
    "term": {t: render(f"term.{t}", "zh_CN")
             for t in ("params", "grads", "optimizer", "activations", "transient", "non_torch")},
    "recompute": {**{r: render(f"option.recompute.{r}", "zh_CN") for r in ("none", "selective", "full")},
                  "sqrt": render("checkpoint.sqrt", "zh_CN")},
}


def chinese_text(kind: str, word: str) -> str:
    """The Chinese of ``word``, one of :data:`CHINESE`'s words of ``kind``."""
    if kind not in CHINESE:
        raise ValueError(f"kind={kind!r} must be one of {sorted(CHINESE)}")
    if word not in CHINESE[kind]:
        raise ValueError(f"word={word!r} is no {kind} of labkit.book.CHINESE; "
                         f"valid: {sorted(CHINESE[kind])}")
    return CHINESE[kind][word]


def overflow_text(term: str, so_far: float, limit: float, language: str = "en",
                  digits: int = 1) -> str:
    """A layout that does not fit, from the planner's numbers (GB): the first memory term whose
    running total passes the limit, that total, the limit; worded as the planner words it
    (``labkit.messages``' "plan.overflow": "params: 141.0 GB of 77.0 GB"), in English or
    Chinese ("zh"), to ``digits`` decimals."""
    if language not in ("en", "zh"):
        raise ValueError(f"language={language!r} must be 'en' or 'zh'")
    check_int("digits", digits, 0, 6)
    return render("plan.overflow", "en" if language == "en" else "zh_CN", term=term,
                  bytes_so_far=so_far * 1e9, limit_bytes=limit * 1e9, digits=digits)


def glue(name: str, value, display: bool = True, *, zh=None):
    """``myst_nb.glue(name, value, display)`` when myst-nb is installed; nothing otherwise.

    With ``zh`` (words or a figure for the Chinese edition) it also glues ``name + ZH_SUFFIX``,
    never displayed."""
    _check_name(name)
    check_bool("display", display)
    if zh is not None:
        _myst_glue(name + ZH_SUFFIX, zh, False)
    return _myst_glue(name, value, display)


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} must be a non-empty str (the key a chapter's {{glue}} uses)")
    if name.endswith(ZH_SUFFIX):
        raise ValueError(f"name={name!r} must not end in {ZH_SUFFIX!r}: pass the Chinese as zh=")


def _myst_glue(name: str, value, display: bool):
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        return None
    return myst_glue(name, value, display=display)


# Where fonts-noto-cjk puts its files: a font installed after matplotlib built its font list (on
# Colab, by apt-get in the running session) is added from here.
CJK_FONT_FILES = "/usr/share/fonts/opentype/noto/Noto*CJK-Regular.ttc"


def installed_cjk_font() -> str | None:
    """The first of :data:`CJK_FONTS` that matplotlib finds installed (DejaVu Sans aside), looking
    again after adding :data:`CJK_FONT_FILES` to its list; None if there is none."""
    import glob

    from matplotlib import font_manager

    for attempt in range(2):
        for name in CJK_FONTS[:-1]:
            try:
                font_manager.findfont(name, fallback_to_default=False)
                return name
            except ValueError:
                continue
        for path in glob.glob(CJK_FONT_FILES) if attempt == 0 else ():
            font_manager.fontManager.addfont(path)
    return None


def draw_chinese() -> str | None:
    """Make matplotlib draw Chinese for the rest of the process (a Chinese lab, from
    ``labkit.setup(lang="zh_CN")``): DejaVu Sans first, so Latin text and numbers look as in the
    English labs, then the installed CJK font for the glyphs it lacks (a family list falls back
    glyph by glyph). Returns the font, or None when none is installed (Chinese shows as boxes)."""
    import matplotlib

    font = installed_cjk_font()
    if font is not None:
        matplotlib.rcParams["font.family"] = ["DejaVu Sans", font]
    return font


@contextlib.contextmanager
def chinese_figures():
    """Matplotlib draws with a CJK font inside, and says nothing when one is missing (Colab):
    the Chinese figure is for the book, which is built where fonts-noto-cjk is installed."""
    import matplotlib

    font_log = logging.getLogger("matplotlib.font_manager")
    level = font_log.level
    font_log.setLevel(logging.ERROR)
    try:
        with matplotlib.rc_context({"font.family": "sans-serif", "font.sans-serif": CJK_FONTS,
                                    "axes.unicode_minus": False}), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*missing from font")
            yield
    finally:
        font_log.setLevel(level)


def glue_figure(name: str, draw):
    """Glue ``draw(english)`` as ``name`` and ``draw(chinese)`` as its Chinese twin (neither
    displayed); returns the English figure. ``draw(t)`` makes the figure and writes each text as
    ``t("english", "中文")``: the data and the numbers are drawn once, by the same code."""
    import matplotlib.pyplot as plt

    if not callable(draw):
        raise TypeError(f"draw={draw!r} must be a function t -> figure")
    _check_name(name)
    english = draw(lambda en, zh: en)
    _myst_glue(name, english, False)  # the PNG is made now: outside the CJK font's context
    with chinese_figures():
        chinese = draw(lambda en, zh: zh)
        _myst_glue(name + ZH_SUFFIX, chinese, False)
    plt.close(chinese)
    return english
