"""Argument checks every labkit module shares: bad input raises naming the argument, the value
and what would be valid (``ValueError("world_size=0 must be an int >= 1")``).

The one place labkit checks an argument's type and range: a bool is not an int, a string is not
a bool, a float must be finite. Every error is an :class:`ArgumentError`, which is both a
``ValueError`` and a ``TypeError``, so either ``except`` catches it. Pure Python: importing it
imports no torch.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["ArgumentError", "check_int", "check_choice", "check_bool", "check_float", "check_positive"]


class ArgumentError(ValueError, TypeError):
    """A bad argument: its name, its value and what would be valid are in the message; ``kind``
    and ``fields`` say the same as data, for :func:`labkit.messages.error_message` to render in
    another language (``ArgumentError("...", kind="int", name="seq_len", value=0, minimum=1)``)."""

    def __init__(self, message: str, kind: str | None = None, **fields):
        super().__init__(message)
        self.kind, self.fields = kind, fields


def check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) in [minimum, maximum]; else raise ValueError."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
        raise ArgumentError(f"{name}={value!r} must be {bound}", "int" if maximum is None else "int_range",
                            name=name, value=value, minimum=minimum, maximum=maximum)
    return value


def check_choice(name: str, value, choices) -> object:
    """Return ``value`` if it is one of ``choices``; else raise ValueError listing them."""
    choices = list(choices)
    if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices) or value not in choices:
        raise ArgumentError(f"{name}={value!r} is unknown; valid choices: {choices}", "choice",
                            name=name, value=value, choices=choices)
    return value


def check_bool(name: str, value) -> bool:
    """Return ``value`` if it is ``True`` or ``False``; anything else ("no", 0, None) raises."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}={value!r} must be True or False", "bool", name=name, value=value)
    return value


def _interval(minimum, maximum, above, below) -> str:
    lo = f"({above:g}" if above is not None else f"[{minimum:g}" if minimum is not None else "(-inf"
    hi = f"{below:g})" if below is not None else f"{maximum:g}]" if maximum is not None else "inf)"
    return f"{lo}, {hi}"


def check_float(name: str, value, minimum: float | None = None, maximum: float | None = None, *,
                above: float | None = None, below: float | None = None) -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool, not a string) in range.

    ``minimum``/``maximum`` are inclusive bounds, ``above``/``below`` exclusive ones:
    ``check_float("dropout", p, 0.0, below=1.0)`` accepts [0, 1).
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        x = float(value)
        ok = ((minimum is None or x >= minimum) and (maximum is None or x <= maximum)
              and (above is None or x > above) and (below is None or x < below))
    if not ok:
        interval = _interval(minimum, maximum, above, below)
        raise ArgumentError(f"{name}={value!r} must be a finite number in {interval}", "float",
                            name=name, value=value, interval=interval)
    return x


def check_positive(name: str, value) -> float:
    """Return ``value`` as a float if it is a finite number > 0 (a time, a rate, a size in bytes)."""
    return check_float(name, value, above=0.0)
