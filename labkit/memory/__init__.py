"""The memory meter: what a training step should need (analytic) and what it does (measured).

``analytic`` imports no torch and is loaded at once; the meter, the figures and the snapshot
(which need torch) are loaded on first use, so that ``labkit.estimate`` runs without torch.
"""

from .analytic import (RECOMPUTE, ActivationBytes, ModelStateBytes, activation_bytes, head_bytes,
                       korthikanti_activation_bytes, llama_layer_bytes, model_state_bytes)

__all__ = [
    # analytic: Chapter 1's formulas
    "ModelStateBytes", "model_state_bytes", "ActivationBytes", "activation_bytes",
    "korthikanti_activation_bytes", "llama_layer_bytes", "head_bytes", "RECOMPUTE",
    # measured: the meter and the one step loop
    "CATEGORIES", "MemoryMeter", "MemoryReport", "measure_forward_backward", "measure_step",
    "optimizer_tensors", "train_step",
    # figures and PyTorch's memory viewer
    "plot_breakdown", "plot_timeline", "dump_memory_snapshot", "memory_snapshot",
]


def _load() -> dict:
    """Import the torch-side submodules (then attributes of this package) and their exports."""
    from .meter import (CATEGORIES, MemoryMeter, MemoryReport, measure_forward_backward, measure_step,
                        optimizer_tensors, train_step)
    from .plot import plot_breakdown, plot_timeline
    from .snapshot import dump_memory_snapshot, memory_snapshot
    return locals()


def __getattr__(name: str):
    """Load the torch-side exports (and submodules) on first use."""
    if name in __all__:
        exports = _load()
        globals().update(exports)  # as the eager imports did: an export wins over a submodule of its name
        return exports[name]
    if name in ("meter", "plot", "snapshot"):
        globals().update(_load())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
