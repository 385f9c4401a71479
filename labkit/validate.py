"""Argument checks every labkit module shares: bad input raises naming the argument, the value
and what would be valid (``ValueError("world_size=0 must be an int >= 1")``)."""

from __future__ import annotations

__all__ = ["check_int", "check_choice"]


def check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) in [minimum, maximum]; else raise ValueError."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value!r} must be {bound}")
    return value


def check_choice(name: str, value, choices) -> object:
    """Return ``value`` if it is one of ``choices``; else raise ValueError listing them."""
    choices = list(choices)
    if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices) or value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; valid choices: {choices}")
    return value
