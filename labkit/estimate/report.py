"""How an estimate prints: a table of its parts in GB (10^9 bytes) with each part's share, in the
language labkit prints in (labkit.messages)."""

from __future__ import annotations

from ..messages import pad, say, width

__all__ = ["breakdown"]


def breakdown(title: str, parts: dict, total: int, notes: tuple = ()) -> str:
    """``title``, then one line per part: its bytes in GB and its share of ``total``. ``parts``'
    keys are kinds' suffixes (``breakdown.params``), as are ``title`` and each note: a kind's
    suffix with its fields, ``("training", {})``."""
    names = {k: say(f"breakdown.{k}") for k in [*parts, "total"]}
    columns = max(width(n) for n in names.values())
    lines = [say(f"breakdown.title.{title[0]}", **title[1])]
    for key, value in parts.items():
        share = f"{100 * value / total:5.1f} %" if total else "    - "
        lines.append(f"  {pad(names[key], columns)}  {value / 1e9:10.3f} GB  {share}")
    lines.append(f"  {pad(names['total'], columns)}  {total / 1e9:10.3f} GB")
    lines += [f"  {say(f'breakdown.note.{kind}', **fields)}" for kind, fields in notes]
    return "\n".join(lines)
