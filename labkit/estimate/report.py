"""How an estimate prints: a table of its parts in GB (10^9 bytes) with each part's share."""

from __future__ import annotations

__all__ = ["breakdown"]


def breakdown(title: str, parts: dict, total: int, notes: tuple = ()) -> str:
    """``title``, then one line per part: its bytes in GB and its share of ``total``."""
    width = max(len(k) for k in [*parts, "total"])
    lines = [title]
    for name, value in parts.items():
        share = f"{100 * value / total:5.1f} %" if total else "    - "
        lines.append(f"  {name:<{width}}  {value / 1e9:10.3f} GB  {share}")
    lines.append(f"  {'total':<{width}}  {total / 1e9:10.3f} GB")
    lines += [f"  {n}" for n in notes]
    return "\n".join(lines)
