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


def setup(seed: int = 0, device: str | None = None, verbose: bool = True) -> torch.device:
    """Seed everything, pick the device and print the versions a lab depends on.

    Returns the chosen ``torch.device``. The printed device is the device *type* only,
    so a notebook's checked output is the same on every CPU or every GPU.
    """
    from .version import __version__

    check_bool("verbose", verbose)
    seed_everything(seed)
    dev = pick_device(device)
    if verbose:
        print(f"Python {platform.python_version()} | torch {torch.__version__} | labkit {__version__}")
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
        print(f"device: {dev.type} ({name}), seed {seed}")
    return dev
