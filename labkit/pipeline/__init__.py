"""Pipeline parallelism (Chapter 6): schedules, their timelines, the stage split and a runtime.

``schedules``: GPipe, 1F1B and interleaved 1F1B as per-rank action lists; ``simulate``: a
timeline from a schedule and costs (``replay``: with a recorded run's durations); ``split``:
stage ranges and the chunks a rank holds; ``comm``: the point-to-point messages, the tied
embedding's exchange and the same-model check; ``runtime``: a schedule executed over real ranks;
``analytic``: bubble and in-flight formulas; ``gantt``: a timeline drawn per rank.

``analytic`` and ``schedules`` import no torch and are loaded at once; the rest on first use.
"""

from .._lazy import lazy_exports
from .analytic import bubble_fraction, max_in_flight, p2p_messages
from .schedules import (SCHEDULES, Action, make_schedule, peak_in_flight, schedule_1f1b,
                        schedule_gpipe, schedule_interleaved)

__all__ = ["bubble_fraction", "max_in_flight", "p2p_messages", "check_same_model",
           "exchange_tied_grad", "plot_gantt", "PipelineResult", "run_schedule", "SCHEDULES",
           "Action", "make_schedule", "peak_in_flight", "schedule_1f1b", "schedule_gpipe",
           "schedule_interleaved", "Timeline", "simulate", "replay", "StageChunk", "build_chunks",
           "split_stages"]

# the torch side loads on first use
__getattr__, __dir__ = lazy_exports(__name__, {
    ".comm": ("check_same_model", "exchange_tied_grad"),
    ".gantt": ("plot_gantt",),
    ".runtime": ("PipelineResult", "run_schedule"),
    ".simulate": ("Timeline", "simulate", "replay"),
    ".split": ("StageChunk", "build_chunks", "split_stages"),
})
