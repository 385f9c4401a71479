"""How busy this machine is, and how much longer than asked to wait because of it (torch-free).

A launch, a collective, a grading kernel or a page load that runs long on a loaded machine is
slow, not broken: their timeouts are multiplied by :func:`timeout_scale` (``LABKIT_TIMEOUT_SCALE``)
and their messages add :func:`busy_note` when the load is above the number of cores.
"""

from __future__ import annotations

import os

__all__ = ["timeout_scale", "busy_note"]


def timeout_scale() -> float:
    """``LABKIT_TIMEOUT_SCALE`` (default 1): how much longer than asked launches wait on a slow machine."""
    raw = os.environ.get("LABKIT_TIMEOUT_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = -1.0
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"LABKIT_TIMEOUT_SCALE={raw!r} must be a positive number (2 doubles every timeout)")
    return scale


def busy_note(load: float | None = None, cores: int | None = None) -> str:
    """A sentence on how busy this machine is ('' when its load is below its number of cores)."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average (Windows)
            return ""
    cores = cores or os.cpu_count() or 1
    if load <= cores:
        return ""
    return (f"this machine is busy (load {load:.1f} on {cores} cores), so this may be a slow run rather "
            "than a hung one: rerun it on a quieter machine, or give it more time with "
            "LABKIT_TIMEOUT_SCALE=4")
