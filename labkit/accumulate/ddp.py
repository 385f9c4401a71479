"""The accumulation window under data parallelism: one all-reduce per window with ``no_sync``.

Every rank divides by the same N, the token count of the whole window over all ranks
(:func:`global_token_count`, one all-reduce of one integer before the window).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..validate import check_int
from .window import IGNORE_INDEX, _accumulate, _no_context, count_tokens

__all__ = ["global_token_count", "accumulate_gradients_ddp", "accumulate_gradients_ddp_naive"]


def global_token_count(microbatches, group=None, ignore_index: int = IGNORE_INDEX) -> int:
    """N over every rank of ``group`` (torch's default group when None): one all-reduce of one int."""
    n = torch.tensor([sum(count_tokens(y, ignore_index) for _, y in microbatches)], dtype=torch.int64,
                     device=microbatches[0][1].device)
    dist.all_reduce(n, group=group)
    if int(n) == 0:
        raise ValueError("the accumulation window has no real tokens on any rank")
    return int(n)


def accumulate_gradients_ddp(ddp_model, microbatches, num_tokens: int, world_size: int,
                             ignore_index: int = IGNORE_INDEX) -> float:
    """Accumulate on a DDP model with one gradient all-reduce per window; return this rank's loss share.

    Micro-steps 1..k-1 run under ``no_sync()``, the last one synchronises. DDP averages over
    ranks, so each rank scales by world_size / N with N = :func:`global_token_count`.
    """
    check_int("num_tokens", num_tokens, 1)
    check_int("world_size", world_size, 1)
    k = len(microbatches)
    sync = (lambda i: ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext())
    return _accumulate(ddp_model, microbatches, [world_size / num_tokens] * k, sync, ignore_index) / world_size


def accumulate_gradients_ddp_naive(ddp_model, microbatches, num_tokens: int, world_size: int,
                                   ignore_index: int = IGNORE_INDEX) -> float:
    """Like :func:`accumulate_gradients_ddp` but all-reducing on every micro-step: k rounds, same result."""
    check_int("num_tokens", num_tokens, 1)
    check_int("world_size", world_size, 1)
    k = len(microbatches)
    return _accumulate(ddp_model, microbatches, [world_size / num_tokens] * k, _no_context, ignore_index) / world_size
