"""A small serving engine: continuous batching over a paged KV cache, and its contiguous baselines.

The :class:`Scheduler` decides each step's batch (arrivals, admission, preemption); the engine
runs it: one forward per admitted prompt, one batched forward (paged attention) for every
decoding sequence, then the next tokens (:func:`decide`), applied to the cache here.
Preemption recomputes rather than swaps: swapping needs a CPU block pool and copies, which a
CPU-only lab cannot show to any advantage; vLLM found the two comparable for blocks of 16 to 64.

``reservation="paged"`` allocates blocks on demand; ``"max"`` reserves ``max_len`` slots per
sequence in one contiguous range at admission (the pre-vLLM systems); ``"oracle"`` reserves the
exact final length. All three run the same forwards; only what is reserved, and so the batch
that fits, differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm  # a text bar: a widget would need JavaScript from a CDN in the book

from ..validate import check_bool, check_choice, check_int
from .analytic import DEFAULT_BLOCK_SIZE
from .cache import PagedKVCache
from .reservation import ContiguousAllocator, Waste
from .sampling import Request, decide
from .scheduler import RESERVATIONS, Scheduler

__all__ = ["Engine", "ServeResult", "RESERVATIONS"]


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
    tokens_forwarded: int = 0  # tokens run through the model: prompts, recomputations, decodes

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")


def paged_slots_by_block(cache, final: dict) -> tuple[int, int, int]:
    """The paged cache's slots (token states, reserved, internal) given each sequence's final
    length, block by block: a block that several sequences hold counts once, as filled and as
    reserved as its fullest holder makes it."""
    bs, tokens, reserved, internal = cache.block_size, 0, 0, 0
    for holders in cache.usage_by_block().values():
        filled = max(min(bs, max(cache.length(sid) - i * bs, 0)) for sid, i in holders)
        will = max(filled, max(min(bs, max(final[sid] - i * bs, 0)) for sid, i in holders))
        tokens, reserved, internal = tokens + filled, reserved + will - filled, internal + bs - will
    return tokens, reserved, internal


def paged_slots_by_sequence(cache, final: dict) -> tuple[int, int, int]:
    """What :func:`paged_slots_by_block` counts, where no block has two holders, a sequence at a
    time: its n blocks' slots min(L, n * bs) filled (L its length), min(max(F, L), n * bs) filled
    or to be (F its final length), the rest beyond its end (a block's count, clamped to [0, bs]
    and summed over the blocks, is that clamped to [0, n * bs])."""
    bs, tokens, reserved, internal = cache.block_size, 0, 0, 0
    for sid, table in cache.tables.items():
        size, length = len(table) * bs, cache.length(sid)
        filled, will = min(length, size), min(max(final[sid], length), size)
        tokens, reserved, internal = tokens + filled, reserved + will - filled, internal + size - will
    return tokens, reserved, internal


class Engine:
    """Serve :class:`Request` traces with ``model`` (a labkit GPT), or with ``model=None``: the
    same scheduling and memory accounting without forwards (every generated token is 0)."""

    def __init__(self, model=None, *, num_blocks, block_size=DEFAULT_BLOCK_SIZE,
                 reservation="paged", max_len=None, max_num_seqs=256, prefix_sharing=True):
        check_choice("reservation", reservation, RESERVATIONS)
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        if max_len is None and model is None:
            raise ValueError("max_len is required when model is None")
        if model is not None and not hasattr(model, "cfg"):
            raise TypeError(f"model ({type(model).__name__}) must be a labkit GPT (with .cfg) or None")
        self.model, self.reservation = model, reservation
        self.max_len = check_int("max_len", model.cfg.seq_len if max_len is None else max_len, 2)
        if model is not None and self.max_len > model.cfg.seq_len:
            raise ValueError(f"max_len={self.max_len} exceeds the model's "
                             f"seq_len={model.cfg.seq_len}")
        self.block_size, self.capacity = block_size, num_blocks * block_size
        # the baselines keep their keys and values in blocks too, with room to spare: what they
        # reserve is accounted by the contiguous allocator below
        blocks = num_blocks if reservation == "paged" else num_blocks + max_num_seqs
        if model is None:
            self.cache = PagedKVCache(1, 1, 1, blocks, block_size, store=False,
                                      prefix_sharing=prefix_sharing)
        else:
            self.cache = PagedKVCache.for_model(model, blocks, block_size,
                                                prefix_sharing=prefix_sharing)
        self.contiguous = None if reservation == "paged" else ContiguousAllocator(self.capacity)

    def _account(self, sched: Scheduler, waste: Waste) -> None:
        """Add this step's slots by use (token states, reservation, internal, external)."""
        waiting, running = sched.waiting, sched.running
        free = sched.free_slots()
        if waiting and free >= sched.slots_needed(waiting[0]) and not sched.fits_now(waiting[0]):
            waste.add(external=free)  # enough free memory, but not in one piece
        if self.contiguous is not None:
            for g in running:
                size, final = sched.range_size(g), g.req.final_len
                tokens = sum(self.cache.length(s.sid) for s in g.seqs)
                waste.add(tokens=tokens, reserved=g.width * min(size, final) - tokens,
                          internal=g.width * (size - min(size, final)))
            return
        final = {s.sid: s.final_len for g in running for s in g.seqs}
        shared = self.cache.allocator.num_shared > 0
        waste.add(*(paged_slots_by_block if shared else paged_slots_by_sequence)(self.cache, final))

    def _forward(self, seqs, num_new):
        """Logits (V,) of the last new token of each sequence, its ``num_new`` slots reserved."""
        if self.model is None:
            return [None] * len(seqs)
        idx = torch.tensor([s.tokens[len(s.tokens) - num_new:] for s in seqs],
                           device=self.cache.k[0].device)  # (B, num_new)
        with torch.no_grad():
            step = self.cache.step([s.sid for s in seqs], num_new)
            return list(self.model(idx, kv_cache=step)[:, -1])  # B x (V,)

    def _step(self, sched: Scheduler, batch, result: ServeResult) -> list:
        """Run one batch: forwards, then the next tokens; returns the requests that finished."""
        rows = iter((self._forward(batch.decoding, 1) if batch.decoding else [])
                    + [row for s, new in batch.prefill for row in self._forward([s], new)])
        result.batch_sizes.append(len(batch.decoding) + len(batch.prefill))
        result.tokens_forwarded += len(batch.decoding) + sum(new for _, new in batch.prefill)
        for g in sched.running:
            d = decide(g, [next(rows) for _ in g.seqs], sched.new_sid)
            for parent, child in d.forks:
                self.cache.fork(parent, child)
            for sid in d.drops:
                self.cache.free_sequence(sid)
            for s, token, score in d.next:
                s.tokens.append(token)
                s.score = score
            g.seqs[:] = [s for s, _, _ in d.next]
            g.fresh = False
        result.tokens_generated += sum(len(g.seqs) for g in sched.running)
        return [g for g in sched.running if g.seqs[0].generated == g.req.max_new_tokens]

    def serve(self, requests, *, progress=False, desc="serving") -> ServeResult:
        """Serve ``requests`` (arrival in steps) to completion and return outputs and measurements.

        A failure part-way (an interrupt, a model error) releases every block the trace held."""
        check_bool("progress", progress)
        if isinstance(requests, Request) or not hasattr(requests, "__iter__"):
            raise TypeError(f"requests must be a list of Request, got {type(requests).__name__}")
        requests = list(requests)
        sched = Scheduler(self.cache, self.contiguous, reservation=self.reservation,
                          max_len=self.max_len, max_num_seqs=self.max_num_seqs)
        sched.check_fits(requests, None if self.model is None else self.model.cfg.vocab_size)
        sched.add(requests)
        result = ServeResult({}, {}, [], [], [], Waste(), 0, 0, 0.0)
        if self.model is not None:
            self.model.eval()
        bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=True)
        start, step = time.perf_counter(), 0
        try:
            while not sched.done:
                batch = sched.schedule(step)
                if batch is None:  # nothing queued: jump to the next arrival
                    step = sched.next_arrival
                    continue
                for g in self._step(sched, batch, result):
                    sched.finish(g)
                    result.outputs[g.rid], score = g.req.outputs(g.seqs)
                    if score is not None:
                        result.scores[g.rid] = score
                    bar.update(1)
                self._account(sched, result.waste)
                result.blocks_used.append(self.cache.num_used_blocks)
                result.blocks_unshared.append(self.cache.num_table_entries)
                step += 1
        except BaseException:
            sched.release_all()
            raise
        finally:
            bar.close()
        if self.model is not None and self.cache.k[0].is_cuda:
            torch.cuda.synchronize(self.cache.k[0].device)
        result.seconds = time.perf_counter() - start
        result.preemptions = sched.preemptions
        return result
