"""Hugging Face's transformers, the independent reference of tests/test_llama.py and
tests/test_moe_hf.py, imported when a test first uses it.

Importing transformers and its model modules (torch._dynamo with them) costs about 2 CPU-seconds,
which every pytest worker paid while collecting those two files, whether or not it then ran one of
their tests. It is pinned in requirements.txt: without it their tests skip, except in CI
(``CI=true``), where collecting them fails.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

INSTALLED = importlib.util.find_spec("transformers") is not None
if not INSTALLED and os.environ.get("CI") == "true":
    raise ImportError("transformers is not installed: it is pinned in requirements.txt, and CI must have it")

needs_hf = pytest.mark.skipif(not INSTALLED, reason="transformers is not installed "
                              "(pip install -r requirements.txt): the independent reference")


def hf_module(module: str = ""):
    """``transformers``, or its module ``transformers.<module>`` (``"models.llama.modeling_llama"``)."""
    return importlib.import_module("transformers" + ("." + module if module else ""))
