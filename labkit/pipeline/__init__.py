"""Pipeline parallelism (Chapter 6): schedules, their timelines, the stage split and a runtime.

``schedules``: GPipe, 1F1B and interleaved 1F1B as per-rank action lists; ``simulate``: a
timeline from a schedule and costs; ``split``: stage ranges and the chunks a rank holds;
``runtime``: a schedule executed over real ranks with send/recv; ``analytic``: bubble and
in-flight formulas; ``gantt``: a timeline drawn per rank.
"""

from .analytic import bubble_fraction, max_in_flight, p2p_messages  # noqa: F401
from .gantt import plot_gantt  # noqa: F401
from .runtime import PipelineResult, exchange_tied_grad, run_schedule  # noqa: F401
from .schedules import (SCHEDULES, Action, make_schedule, peak_in_flight, schedule_1f1b,  # noqa: F401
                        schedule_gpipe, schedule_interleaved)
from .simulate import Timeline, simulate  # noqa: F401
from .split import StageChunk, build_chunks, split_stages  # noqa: F401
