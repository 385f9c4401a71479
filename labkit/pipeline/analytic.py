"""The pipeline's formulas (Huang et al. 2019; Narayanan et al. 2021b, Section 2.2).

Bubble: the idle fraction of a step, (p - 1)/(m + p - 1) for GPipe and 1F1B and
(p - 1)/(v m + p - 1) interleaved (the ideal step is m (t_f + t_b); the bubble adds
(p - 1)(t_f + t_b), or 1/v of it with v chunks per rank). In flight: the most micro-batches whose
activations a stage holds at once. Messages: each micro-batch crosses each stage boundary once
forward (activations) and once backward (their gradients); interleaving makes v p - 1 boundaries.
"""

from __future__ import annotations

from ..validate import ArgumentError, check_int
from .schedules import SCHEDULES

__all__ = ["bubble_fraction", "max_in_flight", "p2p_messages", "default_schedule", "check_pipeline",
           "interleave_allowed"]


def _check(p, m, v):
    for name, value in (("pp_size", p), ("num_microbatches", m), ("v", v)):
        check_int(name, value, 1)


def bubble_fraction(pp_size: int, num_microbatches: int, schedule: str = "gpipe", v: int = 1) -> float:
    """Idle fraction of the step: (p - 1)/(m + p - 1), or (p - 1)/(v m + p - 1) interleaved
    (p = ``pp_size``, m = ``num_microbatches``)."""
    p, m = pp_size, num_microbatches
    _check(p, m, v)
    if schedule in ("gpipe", "1f1b"):
        if v != 1:
            raise ValueError(f"v={v} applies to schedule='interleaved' only, not {schedule!r}")
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")


def max_in_flight(pp_size: int, num_microbatches: int, schedule: str = "gpipe", v: int = 1,
                  rank: int = 0) -> int:
    """Most forwards awaiting their backward on ``rank``: m for GPipe, min(p - rank, m) for 1F1B;
    interleaved, counted in chunks (each 1/v of the stage): 2 (p - rank - 1) + (v - 1) p + 1."""
    p, m = pp_size, num_microbatches
    _check(p, m, v)
    check_int("rank", rank, 0, p - 1)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b" or (schedule == "interleaved" and v == 1):
        return min(p - rank, m)
    if schedule == "interleaved":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)
    raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")


def p2p_messages(pp_size: int, num_microbatches: int, v: int = 1) -> int:
    """Point-to-point messages of one step over the whole pipeline: 2 m (v p - 1)."""
    p, m = pp_size, num_microbatches
    _check(p, m, v)
    return 2 * m * (v * p - 1)


def default_schedule(pp_size: int, num_microbatches: int, v: int = 1) -> str:
    """The schedule a run of p stages, m micro-batches and v chunks a rank uses: "interleaved"
    when v > 1, else "1f1b" when m >= p (its memory bound holds), else "gpipe"."""
    p, m = pp_size, num_microbatches
    _check(p, m, v)
    return "interleaved" if v > 1 else ("1f1b" if m >= p else "gpipe")


def interleave_allowed(n_layer: int, pp_size: int, num_microbatches: int, v: int) -> bool:
    """Whether v > 1 chunks a rank can run: p > 1, a layer or more a chunk (v p <= n_layer; the
    chunks need not be equal: ``labkit.shapes.layer_split``) and p dividing m (micro-batches enter
    in groups of p). The rule :func:`check_pipeline` enforces; the planner's sweep asks it."""
    return v == 1 or (pp_size > 1 and pp_size * v <= n_layer and num_microbatches % pp_size == 0)


def check_pipeline(n_layer: int, pp_size: int, num_microbatches: int, v: int = 1,
                   schedule: str | None = None) -> str:
    """The schedule of a valid pipeline (``schedule``, or :func:`default_schedule`'s), else a
    ValueError naming the argument: p at most n_layer; v > 1 only interleaved, with p > 1, v p at
    most n_layer and p dividing m; GPipe and 1F1B with v = 1. The one home of these rules."""
    p, m = pp_size, num_microbatches
    _check(p, m, v)
    check_int("n_layer", n_layer, 1)
    if p > n_layer:
        raise ArgumentError(f"pp_size={p} must be at most n_layer={n_layer} (a stage holds a layer or more)",
                            "pp_size", pp_size=p, n_layer=n_layer)
    schedule = default_schedule(p, m, v) if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule={schedule!r} must be one of {SCHEDULES}", "choice", name="schedule",
                            value=schedule, choices=list(SCHEDULES))
    if (schedule == "interleaved") != (v > 1) and not (schedule == "interleaved" and v == 1):
        raise ArgumentError(f"v={v} chunks a rank need schedule='interleaved' (and v > 1); got {schedule!r}",
                            "interleave_schedule", v=v, schedule=schedule)
    if not interleave_allowed(n_layer, p, m, v):
        raise ArgumentError(f"v={v} chunks a rank need pp_size > 1 (got {p}), v x pp_size = {v * p} at most "
                            f"n_layer={n_layer} and pp_size dividing num_microbatches={m}", "interleave",
                            v=v, pp_size=p, n_layer=n_layer, num_microbatches=m)
    return schedule
