"""Pipeline parallelism (Chapter 6): schedules, their timelines, the stage split and a runtime.

``schedules``: GPipe, 1F1B and interleaved 1F1B as per-rank action lists; ``simulate``: a
timeline from a schedule and costs; ``split``: stage ranges and the chunks a rank holds;
``comm``: the point-to-point messages, the tied embedding's exchange and the same-model check;
``runtime``: a schedule executed over real ranks; ``analytic``: bubble and in-flight formulas;
``gantt``: a timeline drawn per rank.

``analytic`` and ``schedules`` import no torch and are loaded at once; the rest on first use.
"""

from .analytic import bubble_fraction, max_in_flight, p2p_messages
from .schedules import (SCHEDULES, Action, make_schedule, peak_in_flight, schedule_1f1b,
                        schedule_gpipe, schedule_interleaved)

__all__ = ["bubble_fraction", "max_in_flight", "p2p_messages", "check_same_model",
           "exchange_tied_grad", "plot_gantt", "PipelineResult", "run_schedule", "SCHEDULES",
           "Action", "make_schedule", "peak_in_flight", "schedule_1f1b", "schedule_gpipe",
           "schedule_interleaved", "Timeline", "simulate", "StageChunk", "build_chunks",
           "split_stages"]
_SUBMODULES = ('comm', 'gantt', 'runtime', 'simulate', 'split')


def _load() -> dict:
    """Import the torch-side submodules and return their exports."""
    from .comm import check_same_model, exchange_tied_grad
    from .gantt import plot_gantt
    from .runtime import PipelineResult, run_schedule
    from .simulate import Timeline, simulate
    from .split import StageChunk, build_chunks, split_stages
    return locals()


def __getattr__(name: str):
    """Load the torch-side exports (and submodules) on first use."""
    if name in __all__:
        exports = _load()
        globals().update(exports)  # as the eager imports did: an export wins over a submodule of its name
        return exports[name]
    if name in _SUBMODULES:
        globals().update(_load())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
