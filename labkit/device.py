"""Device choice, determinism and the one call a lab's first cell makes."""

from __future__ import annotations

import os
import platform
import random

import numpy as np
import torch

from .validate import check_bool, check_choice, check_int

__all__ = ["pick_device", "seed_everything", "setup"]


def pick_device(prefer: str | None = None) -> torch.device:
    """Return CUDA when present (or ``prefer`` when given), else CPU.

    ``prefer`` may be ``"cpu"``, ``"cuda"`` or ``None``; the environment variable
    ``LABKIT_DEVICE`` overrides the automatic choice, so a notebook can be forced to CPU.
    """
    choice = prefer if prefer is not None else os.environ.get("LABKIT_DEVICE")
    if choice is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_choice("prefer" if prefer is not None else "LABKIT_DEVICE", choice, ("cpu", "cuda", None))
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("prefer='cuda' but no CUDA device is available; use 'cpu' or None")
    return torch.device(choice)


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch (all devices) and ask cuDNN for determinism."""
    check_int("seed", seed, 0, 2**64 - 1)  # torch.manual_seed's range (True is not a seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def setup(seed: int = 0, device: str | None = None, verbose: bool = True,
          lang: str | None = None) -> torch.device:
    """Seed everything, pick the device and print the versions a lab depends on.

    Returns the chosen ``torch.device``. The printed device is the device *type* only,
    so a notebook's checked output is the same on every CPU or every GPU. ``lang`` ("en",
    "zh_CN"; None keeps the current one) is the language of what labkit prints from then on in
    this process: its tables, reasons and notes (``labkit.messages.use``); the Chinese labs pass
    "zh_CN", which also gives matplotlib a CJK font (``labkit.book.draw_chinese``) or says how to
    install one.
    """
    from . import messages
    from .version import __version__

    check_bool("verbose", verbose)
    if lang is not None:
        messages.use(lang)
    seed_everything(seed)
    dev = pick_device(device)
    font = _figures_in_chinese() if messages.current() == "zh_CN" else ""
    if verbose:
        print(f"Python {platform.python_version()} | torch {torch.__version__} | labkit {__version__}")
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
        print(messages.say("setup.device", device=dev.type, name=name, seed=seed))
        if font is None:
            print(messages.say("setup.no_cjk_font", command="!apt-get -qq install fonts-noto-cjk"))
    return dev


def _figures_in_chinese() -> str | None:
    """A CJK font for matplotlib (labkit.book.draw_chinese); "" without matplotlib."""
    try:
        from .book import draw_chinese
        return draw_chinese()
    except ImportError:
        return ""
