"""Composing the techniques (Chapter 6 onwards): :class:`ParallelDims`, the degrees of a run and its
rank grid, in ``dims``; ``parallelize``: one model sharded by all of them in one order.

The exports load on first use, so ``from labkit.parallel import ParallelDims`` imports no torch
(the torch-free estimator reads a ``ParallelDims``'s degrees).
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__ = ["AXES", "MeshCoords", "ParallelDims", "CHECKPOINTS", "ParallelModel", "parallelize_gpt"]

__getattr__, __dir__ = lazy_exports(__name__, {
    ".dims": ("AXES", "MeshCoords", "ParallelDims"),
    ".parallelize": ("CHECKPOINTS", "ParallelModel", "parallelize_gpt"),
})
