"""A pipeline timeline drawn as a Gantt chart: one row per rank, forwards, backwards, idle."""

from __future__ import annotations

__all__ = ["plot_gantt"]

COLORS = {"F": "#4c72b0", "B": "#dd8452"}


def plot_gantt(timeline, ax=None, title: str | None = None, labels: bool = True,
               fontsize: float = 10):
    """Draw ``timeline`` (a :class:`~labkit.pipeline.simulate.Timeline`) on ``ax``; return ax.

    Forwards blue, backwards orange, idle blank; each box is labelled with its micro-batch
    (and chunk, interleaved) where the label fits. Time in the timeline's unit, from its first
    action. The x axis covers the whole timeline; axes shared with ``sharex`` cover the longest
    drawn on them, so a schedule that finishes earlier shows it.
    """
    import matplotlib.pyplot as plt  # plotting only: not needed to import labkit

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * timeline.pp_size))
    t0 = timeline.start
    for r, events in enumerate(timeline.events):
        for a, start, end in events:
            ax.barh(r, end - start, left=start - t0, color=COLORS[a.kind], edgecolor="white",
                    height=0.8, alpha=0.55 + 0.45 * (a.chunk % 2 == 0))
    ax.set_yticks(range(timeline.pp_size), [f"rank {r}" for r in range(timeline.pp_size)])
    ax.invert_yaxis()
    ax._labkit_makespan = timeline.makespan
    siblings = ax.get_shared_x_axes().get_siblings(ax)
    ax.set_xlim(0, max(getattr(s, "_labkit_makespan", 0.0) for s in siblings))
    if labels:  # a label that would not fit inside its box is left out
        px = ax.get_window_extent().width / ax.get_xlim()[1]  # pixels per time unit
        em = fontsize * ax.figure.dpi / 72  # pixels per point of text
        for r, events in enumerate(timeline.events):
            for a, start, end in events:
                text = repr(a)[1:]
                if (end - start) * px >= 0.65 * em * len(text) + 4:
                    ax.text((start + end) / 2 - t0, r, text, ha="center", va="center",
                            fontsize=fontsize, clip_on=True)
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble {timeline.bubble:.1%}")
    return ax
