"""Composing the techniques (Chapter 6 onwards): :class:`ParallelDims`, the degrees of a run and its
rank grid, in ``dims``; ``parallelize``: one model sharded by all of them in one order.

The exports load on first use, so ``from labkit.parallel import ParallelDims`` imports no torch
(the torch-free estimator reads a ``ParallelDims``'s degrees).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the exports are, for readers and type checkers; loaded lazily below
    from .dims import AXES, MeshCoords, ParallelDims
    from .parallelize import CHECKPOINTS, ParallelModel, parallelize_gpt

__all__ = ["AXES", "MeshCoords", "ParallelDims", "CHECKPOINTS", "ParallelModel", "parallelize_gpt"]

_WHERE = {"AXES": "dims", "MeshCoords": "dims", "ParallelDims": "dims", "CHECKPOINTS": "parallelize",
          "ParallelModel": "parallelize", "parallelize_gpt": "parallelize"}


def __getattr__(name: str):
    """Load an export (and its module) on first use."""
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
