"""A pipeline timeline: from a schedule and per-action costs (simulated) or from a recorded run.

``simulate`` starts each action as soon as its rank is free and its input has arrived: the
forward of micro-batch i at virtual stage k needs its forward at stage k - 1, the backward needs
the backward at stage k + 1 (the last stage needs its own forward). A schedule that can never
proceed (a rank waiting on an action that waits on it) raises ``ValueError``. ``replay``
simulates a schedule with the durations a recorded run measured for each of its actions.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import Action

__all__ = ["Timeline", "simulate", "replay"]


@dataclass
class Timeline:
    """What each rank ran and when: ``events[r]`` is a list of (action, start, end) in seconds."""

    events: list

    @property
    def pp_size(self) -> int:
        return len(self.events)

    @property
    def start(self) -> float:
        return min(e[1] for ev in self.events for e in ev)

    @property
    def makespan(self) -> float:
        """From the first action's start to the last action's end, over all ranks."""
        return max(e[2] for ev in self.events for e in ev) - self.start

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.events[rank])

    def idle_fraction(self, rank: int) -> float:
        return 1.0 - self.busy(rank) / self.makespan

    @property
    def bubble(self) -> float:
        """The idle fraction of the step, over all ranks: 1 - busy / (p * makespan)."""
        return 1.0 - sum(self.busy(r) for r in range(self.pp_size)) / (self.pp_size * self.makespan)


def _cost(cost, rank: int, action: Action) -> float:
    return float(cost(rank, action) if callable(cost) else cost)


def simulate(schedule: list[list[Action]], forward_cost=1.0, backward_cost=2.0,
             comm_cost=0.0) -> Timeline:
    """The timeline of ``schedule`` with costs in seconds (numbers, or ``f(rank, action)``).

    ``comm_cost`` is added between an action and the dependent action on another rank.
    """
    p = len(schedule)
    if p == 0:
        raise ValueError("schedule=[] must list the actions of at least one rank")
    v = 1 + max(a.chunk for acts in schedule for a in acts)
    last = v * p - 1
    done: dict = {}  # (kind, mb, virtual stage) -> end time
    pos, free = [0] * p, [0.0] * p
    events = [[] for _ in range(p)]
    remaining = sum(map(len, schedule))
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                k = a.chunk * p + r  # virtual stage
                if a.kind == "F":
                    dep = ("F", a.mb, k - 1) if k > 0 else None
                else:
                    dep = ("B", a.mb, k + 1) if k < last else ("F", a.mb, k)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (comm_cost if dep[2] % p != r else 0.0)
                start = max(free[r], ready)
                cost = forward_cost if a.kind == "F" else backward_cost
                end = start + _cost(cost, r, a)
                done[(a.kind, a.mb, k)] = end
                events[r].append((a, start, end))
                free[r], pos[r], remaining, progressed = end, pos[r] + 1, remaining - 1, True
        if not progressed:
            stuck = {r: schedule[r][pos[r]] for r in range(p) if pos[r] < len(schedule[r])}
            raise ValueError(f"schedule deadlocks: ranks wait on each other at {stuck}")
    return Timeline(events)


def replay(recorded: Timeline, schedule: list[list[Action]], comm_cost=0.0) -> Timeline:
    """``schedule`` simulated with the durations ``recorded`` measured for each of its actions:
    the timeline of a runtime that waits for nothing but its inputs (and ``comm_cost`` seconds
    a message), on the same unequal stages a loaded machine made of the equal ones."""
    if not isinstance(recorded, Timeline):
        raise TypeError(f"recorded={type(recorded).__name__}: give a Timeline of a run")
    took = {(r, a): end - start for r, ev in enumerate(recorded.events) for a, start, end in ev}
    wanted = {(r, a) for r, acts in enumerate(schedule) for a in acts}
    if took.keys() != wanted:
        odd = sorted(took.keys() ^ wanted)[:3]
        raise ValueError(f"recorded and schedule hold different actions (rank, action): {odd}")
    return simulate(schedule, lambda r, a: took[(r, a)], lambda r, a: took[(r, a)], comm_cost)
