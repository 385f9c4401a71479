"""Pipeline schedules as pure functions: for each rank, the ordered list of actions it runs.

An action is the forward ("F") or backward ("B") of micro-batch ``mb`` through the rank's model
chunk ``chunk``. With ``v`` chunks per rank (interleaving), rank r holds virtual stages
r, r + p, ..., r + (v - 1) p, so chunk c of rank r is virtual stage c p + r; without
interleaving every rank holds one chunk, 0. GPipe (Huang et al. 2019), 1F1B = PipeDream-Flush
(Narayanan et al. 2021a) and the interleaved 1F1B of Narayanan et al. (2021b), in Megatron-LM's
order. ``peak_in_flight`` counts, from an action list, the most forwards awaiting their backward.
"""

from __future__ import annotations

from typing import NamedTuple

from ..validate import check_choice, check_int

__all__ = ["Action", "schedule_gpipe", "schedule_1f1b", "schedule_interleaved", "make_schedule",
           "peak_in_flight", "peak_layers_in_flight", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One step of a rank's schedule: ``kind`` "F" or "B", micro-batch ``mb``, model ``chunk``."""

    kind: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def schedule_gpipe(pp_size: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe: every rank runs the forwards of all m micro-batches, then all their backwards."""
    p = check_int("pp_size", pp_size, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def schedule_1f1b(pp_size: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): rank r runs p - r - 1 warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards. Needs m >= p."""
    p = check_int("pp_size", pp_size, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    if m < p:
        raise ValueError(f"num_microbatches={m} < pp_size={p}: 1F1B needs m >= p to reach its "
                         "steady state (use schedule_gpipe for fewer micro-batches)")
    out = []
    for r in range(p):
        w = p - r - 1  # warm-up forwards
        acts = [Action("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action("F", w + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - w, m)]
        out.append(acts)
    return out


def schedule_interleaved(pp_size: int, num_microbatches: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B: each rank holds v chunks; micro-batches go through the chunks in groups
    of p (Megatron-LM's order). Rank r warms up with 2 (p - r - 1) + (v - 1) p chunk-forwards.
    Needs m to be a multiple of p; v = 1 is :func:`schedule_1f1b`."""
    p = check_int("pp_size", pp_size, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    check_int("v", v, 1)
    if v == 1:  # one chunk per rank: plain 1F1B
        return schedule_1f1b(p, m)
    if m % p:
        raise ValueError(f"num_microbatches={m} must be a multiple of pp_size={p} for the "
                         "interleaved schedule (micro-batches enter in groups of p)")
    total = m * v

    def fwd(k):  # k-th chunk-forward of a rank -> (micro-batch, chunk)
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = []
    for r in range(p):
        w = min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [fwd(k) for k in range(w)]
        for i in range(total - w):
            acts += [fwd(w + i), bwd(i)]
        acts += [bwd(k) for k in range(total - w, total)]
        out.append(acts)
    return out


def make_schedule(name: str, pp_size: int, num_microbatches: int, v: int = 1) -> list[list[Action]]:
    """The schedule called ``name`` ("gpipe", "1f1b" or "interleaved"); ``v`` chunks a rank
    (interleaved only: GPipe and 1F1B hold one chunk, so they refuse v != 1)."""
    check_choice("schedule", name, SCHEDULES)
    check_int("v", v, 1)
    if name == "interleaved":
        return schedule_interleaved(pp_size, num_microbatches, v)
    if v != 1:
        raise ValueError(f"v={v} applies to schedule='interleaved' only: {name!r} runs one chunk "
                         "a rank (v=1)")
    return (schedule_gpipe if name == "gpipe" else schedule_1f1b)(pp_size, num_microbatches)


def peak_in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) forwards whose backward has not yet run, over a rank's list."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def peak_layers_in_flight(actions: list[Action], chunk_layers: list[int]) -> int:
    """The most layers' activations a rank holds at once over its action list: the sum, over the
    forwards awaiting their backward, of their chunk's layers (``chunk_layers[c]`` for chunk c).
    With chunks of equal size it is :func:`peak_in_flight` times that size."""
    live = peak = 0
    for a in actions:
        live += chunk_layers[a.chunk] if a.kind == "F" else -chunk_layers[a.chunk]
        peak = max(peak, live)
    return peak
