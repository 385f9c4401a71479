"""What the exporters share: the notes, the refusals, the RunConfig of a plan (torch-free)."""

from __future__ import annotations

import warnings

from ...messages import say
from ...parallel.config import RunConfig
from ...validate import check_float

__all__ = ["ExportNote", "note", "refuse", "run_of", "clip"]


class ExportNote(UserWarning):
    """A setting the engine expresses differently from the plan (said, never dropped), in the
    language labkit prints in; ``engine``, ``kind`` and ``fields`` are what it was rendered from
    (labkit.messages), to say it in another."""


def note(engine: str, kind: str, **fields) -> None:
    """Warn an :class:`ExportNote` of ``engine``: the catalogue's ``kind`` with ``fields``, rendered
    now (``labkit.messages.current``), the engine's name before it."""
    warning = ExportNote(say("export.note", engine=engine, text=say(kind, **fields)))
    warning.engine, warning.kind, warning.fields = engine, kind, fields
    warnings.warn(warning, stacklevel=3)


def refuse(engine: str, message: str):
    raise ValueError(f"{engine} cannot express {message}")


def run_of(plan) -> RunConfig:
    """The RunConfig of a TrainingPlan (its ``run``) or a RunConfig itself."""
    run = getattr(plan, "run", plan)
    if not isinstance(run, RunConfig):
        raise TypeError(f"plan={plan!r} must be a labkit.plan.TrainingPlan or a labkit.parallel.RunConfig")
    if run.seq_len is None:
        raise ValueError("plan.seq_len=None: resolve it first (RunConfig.check(shape), or plan_training's plans)")
    return run


def clip(gradient_clipping: float) -> float:
    return check_float("gradient_clipping", gradient_clipping, minimum=0.0)
