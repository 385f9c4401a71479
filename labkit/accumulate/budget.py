"""The micro-batch for a memory budget: measured peaks, searched by bisection."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..memory.meter import MemoryMeter, MemoryReport, train_step
from ..messages import say
from ..validate import check_int
from .analytic import num_microbatches

__all__ = ["measure_microbatch", "microbatch_for_budget"]


def measure_microbatch(model: nn.Module, make_optimizer, micro_batch_size: int, seq_len: int,
                       vocab_size: int | None = None) -> MemoryReport:
    """Measured memory of a steady-state accumulation window at micro-batch ``micro_batch_size``.

    ``model(x, y)`` must return the loss (as :class:`labkit.model.GPT` does). On a copy of
    ``model`` with ``make_optimizer(params)``: one warm-up step (so the optimizer
    states exist), then the measured window: two micro-steps (the second runs with the gradients
    of the first allocated, as every later one does) and the optimizer step.
    """
    check_int("micro_batch_size", micro_batch_size, 1)
    check_int("seq_len", seq_len, 1)
    vocab_size = vocab_size or model.cfg.vocab_size
    probe = copy.deepcopy(model)
    optimizer = make_optimizer(probe.parameters())
    device = next(probe.parameters()).device
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(vocab_size, (micro_batch_size, seq_len), generator=gen).to(device)  # (B, T)
    y = torch.randint(vocab_size, (micro_batch_size, seq_len), generator=gen).to(device)  # (B, T)
    train_step(probe, optimizer, (x, y))  # warm-up: the optimizer states now exist
    with MemoryMeter(probe, optimizer) as meter:
        train_step(probe, None, (x, y), meter=meter)  # micro-step 1: forward and backward
        train_step(probe, optimizer, (x, y), meter=meter)  # micro-step 2 beside its gradients, the step
    return meter.report()


def microbatch_for_budget(peak_bytes, global_batch_size: int, budget_bytes: int) -> tuple[int, int]:
    """The largest micro-batch b <= B whose ``peak_bytes(b)`` fits ``budget_bytes``, and k = ceil(B / b).

    ``peak_bytes`` maps a micro-batch size to a measured peak (e.g. via :func:`measure_microbatch`)
    and must not decrease with b; binary search calls it about log2(B) + 1 times.
    """
    check_int("global_batch_size", global_batch_size, 1)
    check_int("budget_bytes", budget_bytes, 1)
    one = peak_bytes(1)
    if one > budget_bytes:
        raise ValueError(say("raise.budget_below_one", budget_bytes=budget_bytes, one=one))
    lo, hi = 1, global_batch_size  # invariant: peak(lo) fits; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_bytes(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo, num_microbatches(global_batch_size, lo)
