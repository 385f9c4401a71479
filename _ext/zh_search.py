"""Sphinx extension: the Chinese edition's search index in linear time, byte for byte the same.

Sphinx 7.4's Chinese splitter (``sphinx.search.zh.SearchChinese``) adds every Latin word of every
page to one list, repeats included, and asks for each word it stems whether the word is in that
list: a scan of the whole list, some 30,000 times in this book's Chinese edition. Here the list is
the same and membership is answered from a set of the same words, so every word stems as before
and the index is the same (tests/test_i18n.py splits and stems a page's text both ways).
"""

from __future__ import annotations

from sphinx.application import Sphinx
from sphinx.search.zh import SearchChinese


class _Terms(list):
    """A list whose ``in`` is a set's (only ``extend`` adds to it, as SearchChinese does)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def extend(self, words) -> None:
        words = list(words)
        super().extend(words)
        self._seen.update(words)

    def append(self, word) -> None:
        super().append(word)
        self._seen.add(word)

    def __contains__(self, word) -> bool:
        return word in self._seen


class LinearSearchChinese(SearchChinese):
    """SearchChinese with its list of Latin words a :class:`_Terms` of its own (Sphinx's is
    one list shared by every instance, which one edition's build uses once)."""

    def init(self, options: dict[str, str]) -> None:
        super().init(options)
        self.latin_terms = _Terms()


def setup(app: Sphinx) -> dict:
    app.add_search_language(LinearSearchChinese)  # its lang, "zh", serves zh_CN
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
