"""Figures of the memory meter: a step's memory timeline, and predicted beside measured bars."""

from __future__ import annotations

from ..validate import check_positive
from .meter import CATEGORIES, MemoryReport

__all__ = ["plot_timeline", "plot_breakdown"]

COLORS = {"parameters": "#4C72B0", "buffers": "#8C8C8C", "gradients": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52", "temporaries": "#8172B3"}


def plot_timeline(report: MemoryReport, ax=None, unit: float = 2**20, title: str | None = None):
    """Stacked bytes by category after every operator of the step, phases shaded; returns ``ax``."""
    import matplotlib.pyplot as plt

    check_positive("unit", unit)
    ax = ax or plt.subplots(figsize=(9, 3.6))[1]
    xs = range(len(report.ops))
    ax.stackplot(xs, *[[v / unit for v in report.timeline[c]] for c in CATEGORIES],
                 labels=CATEGORIES, colors=[COLORS[c] for c in CATEGORIES], linewidth=0)
    for i, (name, (lo, hi)) in enumerate(report.phase_bounds().items()):
        if name == "(start)":
            continue
        ax.axvspan(lo, hi, color="k", alpha=0.04 * (i % 2 + 1), lw=0)
        ax.text((lo + hi) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8)
    ax.axvline(report.peak_index, color="k", ls=":", lw=1)
    ax.set_xlabel("operator index in the step")
    ax.set_ylabel("MiB" if unit == 2**20 else f"bytes / {unit:g}")
    ax.legend(loc="upper left", fontsize=7, ncol=3, frameon=False)
    ax.margins(x=0)
    if title:
        ax.set_title(title, pad=14)
    return ax


def plot_breakdown(predicted: dict, measured: dict, ax=None, unit: float = 2**20, title: str | None = None):
    """Side-by-side bars of predicted and measured bytes for each key of ``predicted``."""
    import matplotlib.pyplot as plt

    check_positive("unit", unit)
    if not set(predicted) <= set(measured):
        raise ValueError(f"measured={sorted(measured)} must have every key of predicted={sorted(predicted)}")
    ax = ax or plt.subplots(figsize=(6, 3.2))[1]
    keys = list(predicted)
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [predicted[k] / unit for k in keys], width=0.4, label="predicted", color="#BBBBBB")
    ax.bar([x + 0.2 for x in xs], [measured[k] / unit for k in keys], width=0.4, label="measured", color="#4C72B0")
    ax.set_xticks(list(xs), keys, rotation=0)
    ax.set_ylabel("MiB" if unit == 2**20 else f"bytes / {unit:g}")
    ax.legend(frameon=False)
    if title:
        ax.set_title(title)
    return ax
