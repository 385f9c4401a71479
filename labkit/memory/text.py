"""How a :class:`labkit.memory.meter.MemoryReport` prints: its table, worded by labkit.messages in
the language labkit prints in, aligned in display columns (a CJK character takes two)."""

from __future__ import annotations

from ..messages import pad, say

__all__ = ["report_table"]


def _row(name: str, *cells: str) -> str:
    return " ".join([pad(name, 12)] + [pad(c, 14, ">") for c in cells])


def report_table(report, categories) -> str:
    """Bytes by category (``categories``, in order) at the peak and each category's own maximum,
    then the total and where the peak fell (phase and op)."""
    rows = [_row(say("meter.category"), say("meter.at_peak"), say("meter.max"))]
    rows += [_row(say(f"meter.{c}"), f"{report.at_peak[c]:,}", f"{report.max_by_category[c]:,}")
             for c in categories]
    rows.append(_row(say("meter.total"), f"{report.peak_bytes:,}") + "   "
                + say("meter.peak_in", phase=report.peak_phase, op=report.peak_op))
    return "\n".join(rows)
