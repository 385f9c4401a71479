"""Contiguous reservation (the pre-vLLM systems) and the accounting of KV memory waste.

Kwon et al. (2023), Sec. 3 and Fig. 3: a system that gives each request one contiguous slab
wastes memory three ways. *Reservation*: slots held now for tokens the request will produce
later. *Internal fragmentation*: slots beyond the request's final length, never used. *External
fragmentation*: free memory cut into gaps too small for the request that waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_int

__all__ = ["ContiguousAllocator", "Waste"]


class ContiguousAllocator:
    """First-fit allocation of contiguous ranges in one address space of ``capacity`` slots."""

    def __init__(self, capacity: int):
        check_int("capacity", capacity, 1)
        self.capacity = capacity
        self._gaps = [(0, capacity)]  # sorted (start, length) of the free ranges
        self._held: dict[int, int] = {}  # start -> size of each range handed out

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._gaps)

    @property
    def largest_gap(self) -> int:
        return max((length for _, length in self._gaps), default=0)

    def allocate(self, size: int):
        """Start of a free range of ``size`` slots (the first that fits), or None."""
        check_int("size", size, 1)
        for i, (start, length) in enumerate(self._gaps):
            if length >= size:
                if length == size:
                    self._gaps.pop(i)
                else:
                    self._gaps[i] = (start + size, length - size)
                self._held[start] = size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Return a range, merging it with free neighbours."""
        check_int("start", start, 0, self.capacity - 1)
        check_int("size", size, 1, self.capacity - start)
        if self._held.get(start) != size:
            held = "" if start not in self._held else f" (the range at {start} has size {self._held[start]})"
            raise ValueError(f"range (start={start}, size={size}) was not allocated{held}: free exactly "
                             "what allocate() returned")
        del self._held[start]
        merged: list[tuple[int, int]] = []
        for s, n in sorted(self._gaps + [(start, size)]):
            end = merged[-1][0] + merged[-1][1] if merged else 0
            if merged and s < end:
                raise ValueError(f"range (start={start}, size={size}) overlaps free memory: double free")
            if merged and s == end:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._gaps = merged


@dataclass
class Waste:
    """Slot-steps of KV memory by use, summed over the steps of a served trace.

    ``tokens``: slots holding a token's keys and values; ``reserved``: held for tokens still to
    come; ``internal``: held but beyond the final length; ``external``: free but unusable by the
    request at the head of the queue.
    """

    tokens: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0

    @property
    def total(self) -> int:
        return self.tokens + self.reserved + self.internal + self.external

    def fractions(self) -> dict[str, float]:
        """Each kind as a share of the total: token states, reservation, internal, external."""
        total = self.total or 1
        return {"token states": self.tokens / total, "reservation": self.reserved / total,
                "internal fragmentation": self.internal / total,
                "external fragmentation": self.external / total}

    @property
    def utilisation(self) -> float:
        """The share of the KV memory taken from the pool that holds token states."""
        return self.tokens / (self.total or 1)

    def add(self, tokens=0, reserved=0, internal=0, external=0) -> None:
        self.tokens += tokens
        self.reserved += reserved
        self.internal += internal
        self.external += external
