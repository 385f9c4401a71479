"""The memory meter: what a training step should need (analytic) and what it does (measured)."""

from .analytic import (ActivationBytes, ModelStateBytes, activation_bytes, korthikanti_activation_bytes,
                       model_state_bytes)
from .meter import (CATEGORIES, MemoryMeter, MemoryReport, measure_forward_backward, measure_step,
                    optimizer_tensors, train_step)
from .plot import plot_breakdown, plot_timeline
from .snapshot import dump_memory_snapshot, memory_snapshot

__all__ = [
    # analytic: Chapter 1's formulas
    "ModelStateBytes", "model_state_bytes", "ActivationBytes", "activation_bytes",
    "korthikanti_activation_bytes",
    # measured: the meter and the one step loop
    "CATEGORIES", "MemoryMeter", "MemoryReport", "measure_forward_backward", "measure_step",
    "optimizer_tensors", "train_step",
    # figures and PyTorch's memory viewer
    "plot_breakdown", "plot_timeline", "dump_memory_snapshot", "memory_snapshot",
]
