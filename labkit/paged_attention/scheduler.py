"""The scheduler of the serving engine: arrivals, admission and preemption; it returns the batch
of each step and owns the memory each request holds (Kwon et al. 2023, Sec. 4.5; Yu et al.
2022's iteration-level scheduling; nano-vllm keeps its scheduler apart the same way).

Every step:
1. each running sequence reserves a slot for its next token; when blocks run out the request
   that was admitted last is preempted: its blocks are freed and it will be recomputed;
2. waiting requests are admitted first come, first served, while their prompts fit in memory
   and in ``max_num_seqs``.
``reservation="paged"`` allocates blocks on demand; ``"max"`` also takes ``max_len`` slots per
sequence in one contiguous range at admission (the pre-vLLM systems), ``"oracle"`` the exact
final length: what they reserve is held by a :class:`ContiguousAllocator`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..validate import check_choice, check_int
from .sampling import Request, Sequence

__all__ = ["Scheduler", "Group", "Batch", "RESERVATIONS"]

RESERVATIONS = ("paged", "max", "oracle")


@dataclass
class Group:
    """A request in the engine: its live sequences and, for the baselines, its contiguous ranges."""
    rid: int
    req: Request
    seqs: list
    ranges: list = field(default_factory=list)
    fresh: bool = True  # no token generated yet

    @property
    def width(self) -> int:  # sequences it will hold at most
        return max(self.req.n, self.req.beam_width)


@dataclass
class Batch:
    """One step's work: sequences decoding one token, and admitted prompts to prefill."""
    decoding: list  # Sequence
    prefill: list  # (Sequence, tokens to compute)
    admitted: list  # Group


class Scheduler:
    """Queues of one served trace over ``cache`` (and a ``ContiguousAllocator`` for the baselines)."""

    def __init__(self, cache, contiguous, *, reservation, max_len, max_num_seqs):
        self.cache, self.contiguous = cache, contiguous
        self.reservation = check_choice("reservation", reservation, RESERVATIONS)
        self.max_len = check_int("max_len", max_len, 2)
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        self.pending, self.waiting, self.running = deque(), deque(), []
        self.preemptions = 0
        self._sids = iter(range(1, 1 << 62))

    def new_sid(self) -> int:
        return next(self._sids)

    def add(self, requests) -> None:
        """Queue ``requests`` by arrival (their index is their id)."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        self.pending.extend((i, requests[i]) for i in order)

    @property
    def next_arrival(self) -> int:
        return self.pending[0][1].arrival

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def schedule(self, step: int):
        """The :class:`Batch` of ``step``, or None when nothing is queued (see ``next_arrival``)."""
        while self.pending and self.pending[0][1].arrival <= step:
            rid, r = self.pending.popleft()
            self.waiting.append(Group(rid, r, [Sequence.start(self.new_sid(), r)]))
        if not self.waiting and not self.running:
            return None
        preempted = self._reserve_decode_slots()
        decoding = [s for g in self.running for s in g.seqs]
        admitted, prefill = [], []
        while self.waiting and not (preempted and decoding):
            g = self.waiting[0]
            if len(decoding) + len(prefill) + g.width > self.max_num_seqs or not self.take_memory(g):
                break
            self.waiting.popleft()
            for s in g.seqs:  # the prompt (or a preempted sequence) minus any shared prefix
                shared = self.cache.add_sequence(s.sid, s.tokens)
                self.cache.reserve(s.sid, s.tokens[shared:])
                prefill.append((s, len(s.tokens) - shared))
            admitted.append(g)
        self.running += admitted
        return Batch(decoding, prefill, admitted)

    def _reserve_decode_slots(self) -> bool:
        """A slot for each running sequence's next token; preempt the latest admitted if short."""
        i, preempted = 0, False
        while i < len(self.running):
            g = self.running[i]
            need = sum(self.cache.blocks_needed(s.sid, 1) for s in g.seqs)
            while need > self.cache.num_free_blocks and self.running[-1] is not g:
                self._preempt(self.running.pop())
                preempted = True
            if need > self.cache.num_free_blocks:
                self._preempt(self.running.pop(i))
                preempted = True
                continue
            for s in g.seqs:
                self.cache.reserve(s.sid, s.tokens[-1:])
            i += 1
        return preempted

    def _preempt(self, g) -> None:
        """Recompute, not swap: free every block of the request and queue it first."""
        self._release(g)
        self.waiting.appendleft(g)
        self.preemptions += 1

    def finish(self, g) -> None:
        self.running.remove(g)
        self._release(g)

    def release_all(self) -> None:
        """After a failed step: every block and range the trace held goes back."""
        for g in self.running:
            self._release(g)
        for sid in self.cache.sequence_ids():
            self.cache.free_sequence(sid)
        self.running, self.waiting, self.pending = [], deque(), deque()

    def _release(self, g) -> None:
        for s in g.seqs:
            if s.sid in self.cache:
                self.cache.free_sequence(s.sid)
        if self.contiguous is not None:
            for start in g.ranges:
                self.contiguous.free(start, self.range_size(g))
        g.ranges = []

    # --- memory -------------------------------------------------------------------------------
    def range_size(self, g) -> int:
        return self.max_len if self.reservation == "max" else g.req.final_len

    def take_memory(self, g) -> bool:
        """Take the memory a waiting request needs now, if it is free."""
        if self.contiguous is None:
            return (sum(-(-len(s.tokens) // self.cache.block_size) for s in g.seqs)
                    <= self.cache.num_free_blocks)
        for _ in range(g.width):
            start = self.contiguous.allocate(self.range_size(g))
            if start is None:
                self._release(g)
                return False
            g.ranges.append(start)
        return True

    def fits_now(self, g) -> bool:
        """Would ``g`` be admitted with the memory free now? (Nothing is kept.)"""
        if not self.take_memory(g):
            return False
        if self.contiguous is not None:
            self._release(g)
        return True

    def slots_needed(self, g) -> int:
        if self.contiguous is None:
            return sum(len(s.tokens) for s in g.seqs)
        return g.width * self.range_size(g)

    def free_slots(self) -> int:
        if self.contiguous is not None:
            return self.contiguous.num_free
        return self.cache.num_free_blocks * self.cache.block_size

    def check_fits(self, requests, vocab_size=None) -> None:
        """Each request valid, fitting ``max_num_seqs`` and the memory on its own."""
        bs = self.cache.block_size
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"requests[{i}] is a {type(r).__name__}, not a Request")
            r.validate(self.max_len, f"requests[{i}]", vocab_size)
            width = max(r.n, r.beam_width)
            if width > self.max_num_seqs:
                raise ValueError(f"requests[{i}] holds {width} sequences (n or beam_width) but "
                                 f"max_num_seqs={self.max_num_seqs}: it could never be admitted")
            if self.contiguous is None:
                need, have, unit = width * -(-r.final_len // bs), self.cache.num_blocks, "blocks"
            else:
                size = self.max_len if self.reservation == "max" else r.final_len
                need, have, unit = width * size, self.contiguous.capacity, "slots"
            if need > have:
                raise ValueError(f"requests[{i}] needs {need} of the cache's {have} {unit} "
                                 f"on its own")
