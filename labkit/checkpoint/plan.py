"""Checkpointing plans: which blocks keep their activations and which recompute them (Chapter 3).

A :class:`Plan` splits a model's blocks into consecutive segments, each with a mode: ``"none"``
(keep every activation), ``"selective"`` (recompute the attention core only, Korthikanti et al.
2022) or ``"full"`` (keep the segment's input, recompute the segment in backward, Chen et al.
2016). :func:`make_plan` gives the plan of a named policy. The mechanism (``policies``), the
formulas (``analytic``) and the planner (``planner``) all read plans from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..memory.analytic import RECOMPUTE
from ..validate import check_choice, check_int

__all__ = ["MODES", "POLICIES", "Plan", "make_plan"]

MODES = RECOMPUTE  # ("none", "selective", "full"): the one list, in labkit.memory.analytic
POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget")


@dataclass(frozen=True)
class Plan:
    """Consecutive segments ``(mode, n_blocks)`` covering the blocks in order."""

    segments: tuple

    def __post_init__(self):
        for mode, n in self.segments:
            try:
                check_choice("mode", mode, MODES)
                check_int("n_blocks", n, 1)
            except ValueError as e:
                raise ValueError(f"segment ({mode!r}, {n!r}): mode must be one of {list(MODES)}, "
                                 f"n_blocks an int >= 1 ({e})") from None
            if mode != "full" and n != 1:
                raise ValueError(f"segment ({mode!r}, {n}): only 'full' segments may span several blocks")

    @property
    def n_layer(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def modes(self) -> list[str]:
        """The mode of each block."""
        return [mode for mode, n in self.segments for _ in range(n)]

    def bounds(self):
        """(start, stop, mode) of each segment."""
        start = 0
        for mode, n in self.segments:
            yield start, start + n, mode
            start += n

    def __str__(self):
        """One letter a block, N(one), S(elective), F(ull); a full segment in brackets: ``N [FF] S``."""
        return " ".join("[" + "F" * n + "]" if m == "full" else m[0].upper() for m, n in self.segments)


def make_plan(policy: str, n_layer: int, k: int | None = None) -> Plan:
    """The plan of a named policy for ``n_layer`` blocks (``"budget"`` needs the planner).

    ``every_k`` recomputes blocks k, 2k, ... (1-based); ``sqrt`` cuts the blocks into segments of
    ceil(sqrt(n_layer)) blocks, keeping only each segment's input (Chen et al. 2016, Sec. 4.1).
    """
    check_choice("policy", policy, POLICIES)
    check_int("n_layer", n_layer, 1)
    if policy == "every_k":
        try:
            check_int("k", k, 1, n_layer)
        except ValueError:
            raise ValueError(f"k={k!r} must be an int in [1, n_layer={n_layer}] for policy='every_k' "
                             "(a larger k would checkpoint no block)") from None
        return Plan(tuple(("full" if (i + 1) % k == 0 else "none", 1) for i in range(n_layer)))
    if k is not None:
        raise ValueError(f"k={k!r} is only used by policy='every_k', not policy={policy!r}")
    if policy == "budget":
        raise ValueError("policy='budget' is planned from a budget: use apply_checkpointing(..., budget=...)")
    if policy == "sqrt":
        size = math.isqrt(n_layer - 1) + 1  # ceil(sqrt(n_layer))
        return Plan(tuple(("full", min(size, n_layer - s)) for s in range(0, n_layer, size)))
    return Plan(tuple((policy, 1) for _ in range(n_layer)))
