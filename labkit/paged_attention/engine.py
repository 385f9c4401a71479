"""A small serving engine: continuous batching over a paged KV cache, and its contiguous baselines.

Every step (Kwon et al. 2023, Sec. 4.5; Yu et al. 2022's iteration-level scheduling):
1. each running sequence reserves a slot for its next token; when blocks run out the request
   that arrived last is preempted: its blocks are freed and it will be recomputed;
2. waiting requests are admitted first come, first served, while their prompts' blocks fit;
3. admitted prompts are prefilled (one forward each), running sequences decode one token
   (one batched forward with paged attention), finished requests leave the batch.
Preemption recomputes rather than swaps: swapping needs a CPU block pool and copies, which a
CPU-only lab cannot show to any advantage; vLLM found recomputation cheaper for small blocks.

``reservation="paged"`` allocates blocks on demand; ``"max"`` reserves ``max_len`` slots per
sequence in one contiguous range at admission (the pre-vLLM systems); ``"oracle"`` reserves the
exact final length. All three run the same forwards; only what is reserved, and so the batch
that fits, differs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm  # a text bar: a widget would need JavaScript from a CDN in the book

from .analytic import DEFAULT_BLOCK_SIZE
from .cache import PagedKVCache
from .reservation import ContiguousAllocator, Waste
from .sampling import Request, Sequence, decide

__all__ = ["Engine", "ServeResult", "RESERVATIONS"]

RESERVATIONS = ("paged", "max", "oracle")


@dataclass
class _Group:
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
class ServeResult:
    """What a served trace produced and what it measured, step by step."""
    outputs: dict  # rid -> tokens (n = 1), or a list of token lists (n > 1, best beam first)
    scores: dict  # rid -> beam scores (beam search only)
    batch_sizes: list  # sequences forwarded at each step
    blocks_used: list  # distinct blocks held at each step (paged cache)
    blocks_unshared: list  # blocks the same sequences would hold without sharing
    waste: Waste
    preemptions: int
    tokens_generated: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")


class Engine:
    """Serve :class:`Request` traces with ``model`` (a labkit GPT), or with ``model=None``: the
    same scheduling and memory accounting without forwards (every generated token is 0)."""

    def __init__(self, model=None, *, num_blocks, block_size=DEFAULT_BLOCK_SIZE, reservation="paged",
                 max_len=None, max_num_seqs=256, prefix_sharing=True):
        if reservation not in RESERVATIONS:
            raise ValueError(f"reservation={reservation!r} must be one of {RESERVATIONS}")
        if max_len is None and model is None:
            raise ValueError("max_len is required when model is None")
        self.model, self.reservation, self.max_num_seqs = model, reservation, max_num_seqs
        self.max_len = max_len or model.cfg.seq_len
        if model is not None and self.max_len > model.cfg.seq_len:
            raise ValueError(f"max_len={self.max_len} exceeds the model's seq_len={model.cfg.seq_len}")
        self.block_size, self.capacity = block_size, num_blocks * block_size
        # the baselines keep their keys and values in blocks too, with room to spare: what they
        # reserve is accounted by the contiguous allocator below
        blocks = num_blocks if reservation == "paged" else num_blocks + max_num_seqs
        if model is None:
            self.cache = PagedKVCache(1, 1, 1, blocks, block_size, store=False, prefix_sharing=prefix_sharing)
        else:
            self.cache = PagedKVCache.for_model(model, blocks, block_size, prefix_sharing=prefix_sharing)
        self.contiguous = None if reservation == "paged" else ContiguousAllocator(self.capacity)

    # --- memory -----------------------------------------------------------------------------
    def _range_size(self, g) -> int:
        return self.max_len if self.reservation == "max" else g.req.final_len

    def _admit_memory(self, g) -> bool:
        """Take the memory a waiting request needs now, if it is free."""
        if self.contiguous is None:
            bs = self.block_size
            return sum(-(-len(s.tokens) // bs) for s in g.seqs) <= self.cache.allocator.num_free
        for _ in range(g.width):
            start = self.contiguous.allocate(self._range_size(g))
            if start is None:
                self._release_ranges(g)
                return False
            g.ranges.append(start)
        return True

    def _release_ranges(self, g):
        for start in g.ranges:
            self.contiguous.free(start, self._range_size(g))
        g.ranges = []

    def _need(self, g) -> int:
        if self.contiguous is None:
            return sum(len(s.tokens) for s in g.seqs)
        return g.width * self._range_size(g)

    def _account(self, running, waiting, waste: Waste):
        """Add this step's slots by use (token states, reservation, internal, external)."""
        bs, alloc = self.block_size, self.cache.allocator
        free = self.contiguous.num_free if self.contiguous else alloc.num_free * bs
        if waiting and free >= self._need(waiting[0]):  # enough free memory: does it fit?
            if not self._admit_memory(waiting[0]):
                waste.add(external=free)
            elif self.contiguous is not None:
                self._release_ranges(waiting[0])
        if self.contiguous is not None:
            for g in running:
                size, final = self._range_size(g), g.req.final_len
                tokens = sum(self.cache.lengths[s.sid] for s in g.seqs)
                waste.add(tokens=tokens, reserved=g.width * min(size, final) - tokens,
                          internal=g.width * (size - min(size, final)))
            return
        final = {s.sid: s.final_len for g in running for s in g.seqs}
        if alloc.num_shared == 0:  # every block has one holder: count per sequence
            for sid, table in self.cache.tables.items():
                n, held = self.cache.lengths[sid], len(table) * bs
                waste.add(tokens=n, reserved=min(held, final[sid]) - n, internal=max(held - final[sid], 0))
            return
        filled, will = {}, {}
        for sid, table in self.cache.tables.items():  # shared blocks: count each physical block once
            n, f = self.cache.lengths[sid], final[sid]
            for i, b in enumerate(table):
                filled[b] = max(filled.get(b, 0), min(bs, max(n - i * bs, 0)))
                will[b] = max(will.get(b, 0), min(bs, max(f - i * bs, 0)), filled[b])
        for b in filled:
            waste.add(tokens=filled[b], reserved=will[b] - filled[b], internal=bs - will[b])

    # --- the loop ---------------------------------------------------------------------------
    def _forward(self, seqs, num_new):
        """Logits (B, V) of the last new token of each sequence, its ``num_new`` slots reserved."""
        if self.model is None:
            return [None] * len(seqs)
        idx = torch.tensor([s.tokens[len(s.tokens) - num_new:] for s in seqs], device=self.cache.k[0].device)
        with torch.no_grad():
            return list(self.model(idx, kv_cache=self.cache.step([s.sid for s in seqs], num_new))[:, -1])

    def _preempt(self, g, waiting):
        """Recompute, not swap: free every block of the request and queue it first."""
        for s in g.seqs:
            self.cache.free_sequence(s.sid)
        if self.contiguous is not None:
            self._release_ranges(g)
        waiting.appendleft(g)

    def _check_fits(self, requests):
        for i, r in enumerate(requests):
            r.validate(self.max_len, f"requests[{i}]")
            width = max(r.n, r.beam_width)
            if self.contiguous is None:
                need, have = width * -(-r.final_len // self.block_size), self.cache.allocator.num_blocks
            else:
                need, have = width * (self.max_len if self.reservation == "max" else r.final_len), self.capacity
            if need > have:
                raise ValueError(f"requests[{i}] needs {need} of the cache's {have} "
                                 f"{'blocks' if self.contiguous is None else 'slots'} on its own")

    def serve(self, requests, *, progress=False, desc="serving") -> ServeResult:
        """Serve ``requests`` (arrival in steps) to completion and return outputs and measurements."""
        self._check_fits(requests)
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        pending = deque((i, requests[i]) for i in order)
        waiting, running, sids = deque(), [], iter(range(1, 1 << 62))
        result = ServeResult({}, {}, [], [], [], Waste(), 0, 0, 0.0)
        new_sid = sids.__next__
        bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=True)
        start, step = time.perf_counter(), 0
        if self.model is not None:
            self.model.eval()
        while pending or waiting or running:
            while pending and pending[0][1].arrival <= step:
                rid, r = pending.popleft()
                waiting.append(_Group(rid, r, [Sequence.start(new_sid(), r)]))
            if not waiting and not running:
                step = pending[0][1].arrival
                continue
            # 1. a slot for each running sequence's next token; preempt the latest arrival if short
            i, preempted = 0, False
            while i < len(running):
                g = running[i]
                need = sum(self.cache.blocks_needed(s.sid, 1) for s in g.seqs)
                while need > self.cache.allocator.num_free and running[-1] is not g:
                    self._preempt(running.pop(), waiting)
                    result.preemptions, preempted = result.preemptions + 1, True
                if need > self.cache.allocator.num_free:
                    self._preempt(running.pop(i), waiting)
                    result.preemptions, preempted = result.preemptions + 1, True
                    continue
                for s in g.seqs:
                    self.cache.reserve(s.sid, s.tokens[-1:])
                i += 1
            decoding = [s for g in running for s in g.seqs]
            # 2. admission, first come first served, while the memory and max_num_seqs allow
            admitted, prefill = [], []
            while waiting and not (preempted and decoding):
                g = waiting[0]
                if len(decoding) + len(prefill) + g.width > self.max_num_seqs or not self._admit_memory(g):
                    break
                waiting.popleft()
                for s in g.seqs:  # the prompt (or a preempted sequence) minus any shared prefix
                    shared = self.cache.add_sequence(s.sid, s.tokens)
                    self.cache.reserve(s.sid, s.tokens[shared:])
                    prefill.append((s, len(s.tokens) - shared))
                admitted.append(g)
            # 3. forwards: one per prefill, one for the whole decode batch; then the next tokens
            rows = iter((self._forward(decoding, 1) if decoding else [])
                        + [row for s, new in prefill for row in self._forward([s], new)])
            result.batch_sizes.append(len(decoding) + len(prefill))
            for g in running + admitted:
                decide(g, [next(rows) for _ in range(len(g.seqs))], self.cache, new_sid)
            running += admitted
            result.tokens_generated += sum(len(g.seqs) for g in running)
            # 4. finished requests leave; this step's measurements
            for g in [g for g in running if g.seqs[0].generated == g.req.max_new_tokens]:
                running.remove(g)
                result.outputs[g.rid], score = g.req.outputs(g.seqs)
                if score is not None:
                    result.scores[g.rid] = score
                for s in g.seqs:
                    self.cache.free_sequence(s.sid)
                if self.contiguous is not None:
                    self._release_ranges(g)
                bar.update(1)
            self._account(running, waiting, result.waste)
            result.blocks_used.append(self.cache.allocator.num_used)
            result.blocks_unshared.append(sum(len(t) for t in self.cache.tables.values()))
            step += 1
        if self.model is not None and self.cache.k[0].is_cuda:
            torch.cuda.synchronize(self.cache.k[0].device)
        result.seconds = time.perf_counter() - start
        bar.close()
        return result
