"""The memory meter: what a training step should need (analytic) and what it does (measured)."""

from .analytic import *  # noqa: F401,F403
from .meter import (CATEGORIES, MemoryMeter, MemoryReport, measure_forward_backward, measure_step,  # noqa: F401
                    optimizer_tensors)
from .plot import plot_breakdown, plot_timeline  # noqa: F401
