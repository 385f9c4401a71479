"""The time of one batched decode step against the batch size: what a larger batch costs.

Kwon et al. (2023, Sec. 2.3) note that a GPU decode step is bound by memory traffic, so a larger
batch costs little more per step; on a CPU a step's work, and so its time, grows with the batch.
Measured here, not assumed: the engine's throughput depends on which holds.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..validate import check_int
from .analytic import DEFAULT_BLOCK_SIZE, blocks_for_tokens
from .cache import PagedKVCache

__all__ = ["decode_step_seconds"]


@torch.no_grad()
def decode_step_seconds(model, batch_size, context_len, *, steps=10, block_size=DEFAULT_BLOCK_SIZE):
    """Median seconds of one decode step of ``batch_size`` sequences of ``context_len`` cached
    tokens through a paged cache (the engine's forward), after one warm-up step."""
    check_int("batch_size", batch_size, 1)
    check_int("steps", steps, 1)
    check_int("context_len", context_len, 1, model.cfg.seq_len - steps - 1)
    per_seq = blocks_for_tokens(context_len + steps + 1, block_size)
    cache = PagedKVCache.for_model(model, batch_size * per_seq, block_size, prefix_sharing=False)
    device = cache.k[0].device
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch_size, context_len), generator=gen)
    for i in range(batch_size):
        cache.add_sequence(i, [])
        cache.reserve(i, prompts[i].tolist())
    model(prompts.to(device), kv_cache=cache.step(range(batch_size), context_len))
    token = prompts[:, -1:].to(device)  # (B, 1): any token; only the time is kept
    times = []
    for _ in range(steps + 1):
        for i in range(batch_size):
            cache.reserve(i, [0])
        step = cache.step(range(batch_size), 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(token, kv_cache=step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first step warms up
