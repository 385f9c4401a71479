"""The memory meter: what a training step should need (analytic) and what it does (measured)."""

from .analytic import *  # noqa: F401,F403
from .meter import CATEGORIES, MemoryMeter, MemoryReport, measure_step, optimizer_tensors  # noqa: F401
from .plot import plot_breakdown, plot_timeline  # noqa: F401
